"""Self-distillation data: the target answers the training prompts itself.

At inference the head drafts continuations of the *target's own* text, so training on the target's
answers (instead of the dataset's, written by another model) matches what it will see. The paper notes
a small gain from this for 7B targets ("Training data sensitivity"); a 135M target's answers differ
much more from ChatGPT's, which is where it pays.

Output: a JSONL of ``{"id", "conversations": [{"from": "human", ...}, {"from": "gpt", ...}]}`` records
(first user turn of each conversation, the target's greedy answer), readable by ``eaglespec extract
--data``. Written batch by batch with flush; a rerun skips the ids already in the file.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import EaglespecError
from .data import load_conversations, split


@dataclass
class RegenerateConfig:
    model: str
    out: str  # a .jsonl file
    data: str = "sharegpt"
    max_prompt_len: int = 512
    max_new_tokens: int = 256
    max_conversations: int = 1000
    first_conversation: int = 0  # start of the slice: split the work across machines, or skip what a head already saw
    batch_size: int = 32
    heldout: int = 100  # the same held-out split as `extract`, so held-out prompts are never answered
    seed: int = 0


def _done_ids(path: Path) -> set[int]:
    done: set[int] = set()
    if not path.exists():
        return done
    good = 0
    with path.open("rb") as f:
        for line in f:
            try:
                done.add(int(json.loads(line)["id"]))
                good += len(line)
            except (ValueError, KeyError, TypeError):
                break  # a line cut by an interruption: drop it and everything after
    with path.open("r+b") as f:
        f.truncate(good)
    return done


@torch.inference_mode()
def regenerate(cfg: RegenerateConfig) -> dict:
    """Answer the first user turn of training-split conversations [`first_conversation`, `max_conversations`)
    with the target's greedy decoding (vanilla, batched), appending to `cfg.out`; returns counts and speed."""
    from ..engine import Engine
    from ..models import eos_ids, load_target

    out = Path(cfg.out)
    if out.suffix != ".jsonl":
        raise EaglespecError(f"--out must be a .jsonl file, got {out}")
    if cfg.first_conversation < 0:
        raise EaglespecError(f"--first-conversation must be >= 0, got {cfg.first_conversation}")
    out.parent.mkdir(parents=True, exist_ok=True)
    model, tok = load_target(cfg.model, packed=True)  # pre-packed weights: batched steps are far cheaper on CPU
    train_convs, _ = split(load_conversations(cfg.data), cfg.seed, cfg.heldout)
    prompts = []
    for i, conv in enumerate(train_convs[cfg.first_conversation: cfg.max_conversations], start=cfg.first_conversation):
        first = [m for m in conv if m["role"] == "system"][:1] + [next(m for m in conv if m["role"] == "user")]
        ids = tok.apply_chat_template(first, add_generation_prompt=True, tokenize=True)
        if len(ids) <= cfg.max_prompt_len:
            prompts.append((i, first, ids))
    done = _done_ids(out)
    todo = [p for p in prompts if p[0] not in done]
    win = cfg.batch_size * 8  # sorted by length within windows: little padding, yet a fair sample if stopped early
    todo = [p for w in range(0, len(todo), win) for p in sorted(todo[w: w + win], key=lambda p: len(p[2]))]
    stop = eos_ids(tok, model)
    eng = Engine(model, None)  # plain batched greedy decoding in one preallocated cache
    bar = tqdm(total=len(todo), unit="conv", desc="regenerate", dynamic_ncols=True)
    new_tokens, t_gen = 0, 0.0
    with out.open("a", encoding="utf-8") as f:
        for b in range(0, len(todo), cfg.batch_size):
            batch = todo[b: b + cfg.batch_size]
            t0 = time.perf_counter()
            outs = eng.generate_batch([p[2] for p in batch], cfg.max_new_tokens, method="vanilla", eos_token_ids=stop)
            t_gen += time.perf_counter() - t0
            for (i, first, _), o in zip(batch, outs):
                row = [t for t in o.token_ids if t not in stop]
                new_tokens += len(row)
                answer = tok.decode(row, skip_special_tokens=True)
                turns = [{"from": "system" if m["role"] == "system" else "human", "value": m["content"]} for m in first]
                reply = {"from": "gpt", "value": answer, "truncated": o.finish_reason != "eos"}
                f.write(json.dumps({"id": i, "conversations": turns + [reply]}) + "\n")
            f.flush()
            bar.update(len(batch))
            bar.set_postfix(tok_per_s=f"{new_tokens / max(t_gen, 1e-9):.0f}")
    bar.close()
    return {"answered": len(todo), "already_done": len(done), "new_tokens": new_tokens,
            "tokens_per_s": new_tokens / t_gen if t_gen else None}
