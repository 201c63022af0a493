"""Cost of 1 / 8 / 20-token target forwards for several targets, interleaved in one process, so that a
noisy host moves them all alike (context 256, tree masks; median of the rounds after two).

    python scripts/interleaved_costs.py fp32,int4,bf16,bf16-dot,int4-dot [ROUNDS]
"""
import sys, json, torch, time, statistics
from eaglespec.models import load_target
from eaglespec.engine import Engine
from eaglespec.cache import KVCache
from eaglespec.tree import float_mask
kinds = sys.argv[1].split(",")  # "fp32" or a --quantize kind
ctx = 256
g = torch.Generator().manual_seed(0)
prompt = torch.randint(0, 49152, (ctx,), generator=g).tolist()
engs = {}
for k in kinds:
    m, _ = load_target(quantize=None if k == "fp32" else k)
    e = Engine(m, None); c = KVCache(ctx + 64)
    with torch.inference_mode(): e._target(prompt, 0, c)
    engs[k] = (e, c)
sizes = (1, 8, 20)
masks = {n: float_mask(torch.ones(n, ctx + n, dtype=torch.bool).tril(ctx), torch.float32) for n in sizes}
res = {(k, n): [] for k in kinds for n in sizes}
with torch.inference_mode():
    for rep in range(int(sys.argv[2]) if len(sys.argv) > 2 else 15):
        for k in (kinds if rep % 2 == 0 else kinds[::-1]):
            e, c = engs[k]
            for n in sizes:
                toks = torch.randint(0, 49152, (n,), generator=g).tolist()
                t = time.perf_counter()
                f = e._target(toks, ctx, c, masks[n] if n > 1 else None)
                e.lm_head(f).argmax(-1).tolist()
                res[(k, n)].append(time.perf_counter() - t)
                c.crop(ctx)
print("| target | " + " | ".join(f"{n} tokens (ms)" for n in sizes) + " |")
print("|---|" + "---|" * len(sizes))
for k in kinds:
    print(f"| {k} | " + " | ".join(f"{statistics.median(res[(k, n)][2:]) * 1e3:.1f}" for n in sizes) + " |")
