"""vLLM's side of `eaglespec.bench.engines`, run by the Python of vLLM's own environment (it needs
transformers 5.x, which eaglespec's does not have), so it imports nothing of eaglespec's.

    python vllm_worker.py JOB.json OUT.json

JOB: {"target": HF folder, "head": speculators folder or null, "k": draft tokens, "prompts": [[ids]],
"max_new_tokens": N, "repeats": R}. OUT: per prompt its token ids and decode seconds (the median of
R timed runs after a warm-up), and, with a head, vLLM's draft and acceptance counters.
"""

import json
import os
import statistics
import sys

# run as a script, this file's folder leads sys.path, and its neighbours (datasets.py) would shadow
# the packages of the same names that vLLM and speculators import
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_") and hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0) + m.value
    return out


def main() -> int:
    job = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None
    if job.get("head"):
        spec = {"method": job.get("method", "eagle3"), "model": job["head"], "num_speculative_tokens": job["k"]}
    llm = LLM(model=job["target"], dtype="float32", enforce_eager=True, speculative_config=spec,
              disable_log_stats=False, max_model_len=4096, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], ignore_eos=False)
    llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][0])], sp, use_tqdm=False)  # warm-up
    rows = []
    for ids in job["prompts"]:
        times, tokens, stats = [], None, {}
        for _ in range(job.get("repeats", 1)):
            before = counters(llm)
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
            times.append(time.perf_counter() - t0)
            after = counters(llm)
            stats = {k: after[k] - before.get(k, 0) for k in after}
            tokens = list(out.outputs[0].token_ids)
        rows.append({"tokens": tokens, "seconds": statistics.median(times), "spec": stats})
    json.dump({"rows": rows}, open(sys.argv[2], "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
