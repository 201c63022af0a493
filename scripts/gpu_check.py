"""CUDA speed of the engine on random-weight targets: one prepared check for a short GPU lease.

Per target shape: the cost curve (target forward + LM head on 1..64 tokens after a 256-token
context, and one draft level), our vanilla loop against transformers' `generate` (the baseline's
honesty), and EAGLE rounds (paper and dynamic trees) split into draft / verify / other. Random
weights accept almost nothing, so speed with a trained head is projected from the measured round:
tau tokens per round. Writes gpu_check.json (after every shape) and gpu_check.md to --out.

    python scripts/gpu_check.py --out DIR [--shapes smollm2-135m,llama-7b] [--budget-s 240]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from eaglespec.policy.costmodel import measure
from eaglespec import Engine
from eaglespec.spec.head import EagleDraftHead
from eaglespec.models import compile_decoder

# (family, hidden, intermediate, layers, heads, kv heads, vocab, tied, dtype) of real checkpoints
SHAPES = {
    "smollm2-135m-fp32": ("llama", 576, 1536, 30, 9, 3, 49152, True, torch.float32),
    "llama-2-7b-fp16": ("llama", 4096, 11008, 32, 32, 32, 32000, False, torch.float16),
    "qwen2.5-0.5b-bf16": ("qwen2", 896, 4864, 24, 14, 2, 151936, True, torch.bfloat16),
    "smollm2-135m-bf16": ("llama", 576, 1536, 30, 9, 3, 49152, True, torch.bfloat16),
    "tiny-fp32": ("llama", 64, 128, 2, 4, 2, 256, False, torch.float32),  # a smoke test of this script
}
TAUS = (3.0, 4.0)  # our SmolLM2 head's tau on MT-bench (CPU-measured), and about the paper's 7B figure


def build(shape: str, device: str) -> torch.nn.Module:
    fam, h, inter, layers, heads, kv, vocab, tied, dtype = SHAPES[shape]
    cls, cfg_cls = (LlamaForCausalLM, LlamaConfig) if fam == "llama" else (Qwen2ForCausalLM, Qwen2Config)
    cfg = cfg_cls(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=4096,
                  attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = cls._from_config(cfg, dtype=dtype)
    return model.eval()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_run(fn, runs: int) -> tuple[float, object]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(runs):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


@torch.inference_mode()
def check(shape: str, new: int, runs: int, compiled: bool, device: str) -> dict:
    model = build(shape, device)
    if compiled:
        compile_decoder(model)
    head = EagleDraftHead(model.config).bind(model).eval()
    prompt = torch.randint(2, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    rec: dict = {"shape": shape, "compiled": compiled, "params_m": sum(p.numel() for p in model.parameters()) / 1e6}
    eng = Engine(model, head, tree="paper")
    costs = measure(eng)
    rec["cost_curve_ms"] = {n: round(s * 1e3, 3) for n, s in zip(costs.sizes, costs.verify_s)}
    rec["draft_level_ms"] = round(costs.draft_level_s * 1e3, 3)
    t_van, van = median_run(lambda: eng.generate(prompt, new, method="vanilla"), runs)
    x = torch.tensor([prompt], device=device)
    t_hf, _ = median_run(lambda: model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                                min_new_tokens=new, do_sample=False, pad_token_id=0), runs)
    rec["vanilla_tok_s"], rec["hf_generate_tok_s"] = new / t_van, new / t_hf
    step_ms = (van.stats.time_s - van.stats.prefill_time_s) / max(van.stats.rounds, 1) * 1e3
    rec["vanilla_step_ms"] = step_ms
    for tree in ("paper", "dynamic"):
        e = eng if tree == "paper" else Engine(model, head, tree=tree)
        t, out = median_run(lambda: e.generate(prompt, new, method="eagle"), runs)
        s = out.stats
        r = max(s.rounds, 1)
        round_ms = (s.time_s - s.prefill_time_s) / r * 1e3
        rec[tree] = {"tok_s": new / t, "tau": s.tau, "round_ms": round_ms, "draft_ms": s.draft_time_s / r * 1e3,
                     "verify_ms": s.verify_time_s / r * 1e3,
                     "other_ms": round_ms - (s.draft_time_s + s.verify_time_s) / r * 1e3,
                     "equals_vanilla": out.token_ids == van.token_ids,
                     "projected_speedup": {str(tau): tau * step_ms / round_ms for tau in TAUS}}
    return rec


def markdown(recs: list[dict], device: str) -> str:
    lines = [f"GPU check on {device}, torch {torch.__version__}; random weights, 64-token prompt.", "",
             "| target | vanilla tok/s | HF generate tok/s | step ms | verify 1/8/24/64 tok ms | draft level ms "
             "| paper round ms (draft/verify/other) | projected x at tau 3 / 4 | dynamic round ms | greedy = vanilla |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        if "error" in r:
            lines.append(f"| {r['shape']} | error: {r['error']} |||||||||")
            continue
        c = r["cost_curve_ms"]
        v = "/".join(f"{c.get(n, float('nan')):.1f}" for n in (1, 8, 24, 64))
        p, d = r["paper"], r["dynamic"]
        lines.append(
            f"| {r['shape']}{' (compiled)' if r['compiled'] else ''} | {r['vanilla_tok_s']:.1f} | {r['hf_generate_tok_s']:.1f} "
            f"| {r['vanilla_step_ms']:.2f} | {v} | {r['draft_level_ms']:.2f} "
            f"| {p['round_ms']:.1f} ({p['draft_ms']:.1f}/{p['verify_ms']:.1f}/{p['other_ms']:.1f}) "
            f"| {p['projected_speedup']['3.0']:.2f} / {p['projected_speedup']['4.0']:.2f} | {d['round_ms']:.1f} "
            f"| {p['equals_vanilla']} / {d['equals_vanilla']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--compiled", default="smollm2-135m-bf16", help="shapes to run again under torch.compile")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=240, help="start no new shape after this many seconds")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0, recs = time.time(), []
    device = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    jobs = [(s, False) for s in a.shapes.split(",")] + [(s, True) for s in a.compiled.split(",") if s]
    for shape, compiled in jobs:
        if time.time() - t0 > a.budget_s:
            recs.append({"shape": shape, "compiled": compiled, "error": "skipped: out of time"})
            continue
        try:
            recs.append(check(shape, a.new_tokens, a.runs, compiled, a.device))
        except Exception as e:  # one shape failing must not lose the others
            recs.append({"shape": shape, "compiled": compiled, "error": f"{type(e).__name__}: {e}"[:300]})
        print(json.dumps(recs[-1])[:600], f"[{time.time() - t0:.0f} s]", flush=True)
        (out / "gpu_check.json").write_text(json.dumps({"device": device, "torch": torch.__version__,
                                                        "records": recs}, indent=1))
        if a.device == "cuda":
            torch.cuda.empty_cache()
    (out / "gpu_check.md").write_text(markdown(recs, device))
    print(markdown(recs, device))


if __name__ == "__main__":
    main()
