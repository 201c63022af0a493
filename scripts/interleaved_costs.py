"""Cost of 1 / 8 / 20-token target forwards for several targets, interleaved in one process, so that a
noisy host moves them all alike (context 256, each forward timed as `eaglespec profile` times it:
`costmodel.time_forward`; median of the rounds after two).

    python scripts/interleaved_costs.py fp32,int4,bf16,bf16-dot,int4-dot [ROUNDS]
"""
import statistics
import sys

import torch

from eaglespec.spec.cache import KVCache
from eaglespec.policy.costmodel import time_forward
from eaglespec import Engine
from eaglespec.models import load_target

kinds = sys.argv[1].split(",")  # "fp32" or a --quantize kind
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 15
ctx, sizes = 256, (1, 8, 20)
g = torch.Generator().manual_seed(0)
engines = {}
for k in kinds:
    model, _ = load_target(quantize=None if k == "fp32" else k)
    eng, cache = Engine(model, None), KVCache(ctx + max(sizes))
    with torch.inference_mode():
        eng.target_forward(torch.randint(0, model.config.vocab_size, (ctx,), generator=g).tolist(), 0, cache)
    engines[k] = (eng, cache)
times = {(k, n): [] for k in kinds for n in sizes}
with torch.inference_mode():
    for r in range(rounds):
        for k in (kinds if r % 2 == 0 else kinds[::-1]):
            eng, cache = engines[k]
            for n in sizes:
                toks = torch.randint(0, eng.model.config.vocab_size, (n,), generator=g).tolist()
                times[(k, n)].append(time_forward(eng, cache, ctx, toks))
print("| target | " + " | ".join(f"{n} tokens (ms)" for n in sizes) + " |")
print("|---|" + "---|" * len(sizes))
for k in kinds:
    print(f"| {k} | " + " | ".join(f"{statistics.median(times[(k, n)][2:]) * 1e3:.1f}" for n in sizes) + " |")
