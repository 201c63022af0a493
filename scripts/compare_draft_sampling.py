"""Acceptance (tau) of the two lossless drafting modes at temperature > 0 on MT-bench first turns.

    python scripts/compare_draft_sampling.py --limit 8 --max-new-tokens 64 --temperature 1.0

topk: children are the head's top-k, q one-hot (a rejected sibling is removed from p);
sample: children sampled from the head without replacement, q = the head's renormalised law.
"""

import argparse
import json

import torch

from eaglespec.bench.datasets import load_questions
from eaglespec.cli import default_head
from eaglespec import Engine
from eaglespec.spec.head import EagleDraftHead
from eaglespec.models import load_target
from eaglespec.spec.verify import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = load_target(a.model)
    head = EagleDraftHead.from_pretrained(default_head(a.model), model)
    sp = SamplingParams(a.temperature)
    result = {}
    for mode in ("topk", "sample"):
        eng = Engine(model, head, draft_sampling=mode)
        acc, rounds = 0, 0
        for i, q in enumerate(load_questions("mt_bench", a.limit)):
            ids = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True)
            s = eng.generate(ids, a.max_new_tokens, sp, seed=i, eos_token_ids=[tok.eos_token_id]).stats
            acc += sum(s.accept_lengths)
            rounds += s.rounds
        result[mode] = {"tau": acc / rounds, "rounds": rounds}
    print(json.dumps({"temperature": a.temperature, "questions": a.limit, "max_new_tokens": a.max_new_tokens,
                      **result}))


if __name__ == "__main__":
    main()
