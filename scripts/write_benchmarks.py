"""Write BENCHMARKS.md from a `scripts/benchmarks.sh` run: this host's section is regenerated from the
run's results (a table whose stage the run lacks stays as it was), the other CPU kinds' sections are
kept as they are; the README's headline table (between `<!-- headline -->` and `<!-- /headline -->`)
is rewritten from the run's main stage.

    python scripts/write_benchmarks.py RUN_DIR [BENCHMARKS.md]

RUN_DIR holds one folder per stage (`main`, `int4-q8`, `ablation`, `batch`, `tau80`: each a
`results.json` from `eaglespec bench`; `curve`: a `cost_curve.json` from `eaglespec profile`;
`serve`: a `results.json` from `python -m eaglespec.bench.serving`).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

from eaglespec.bench.datasets import TITLES

DOCS = Path(__file__).resolve().parents[1] / "docs"
HEADER = """# Benchmarks

Every table below is written by `scripts/benchmarks.sh` (then `scripts/write_benchmarks.py`) and
names the host, CPU, date and commit it ran on. Speeds differ a lot between hosts (AMD EPYC Zen 4
and Zen 5 hosts are both common here), so each CPU kind has its own section; compare numbers only
within one section.

## Method

- **Target and head**: SmolLM2-135M-Instruct and the shipped head ([MODEL_CARD.md](MODEL_CARD.md)).
  fp32 is the exact model, its layers streamed as their exact 4- and 8-bit codes (the fp32
  weights are a dequantized GGUF: the same logits bit for bit); `int4-q8` is a quantized target
  with its own vanilla. Every method of a table runs the same target in the same process. The
  Qwen2.5-Coder-0.5B-Instruct tables run its shipped head (its card in
  `src/eaglespec/heads/qwen2.5-coder-0.5b-instruct`), 4 questions per set, and llama.cpp on its GGUF
  (Q4_K, Q5_0, Q6_K and Q8_0 blocks).
- **Questions**: first turns, 8 per set spread evenly over it (MT-bench: one per category), 128
  new tokens, chat template, T = 0 and T = 1 (top-p 1).
- **Methods**: `vanilla` is eaglespec's plain decoding (one token per forward, same kernels and
  cache, the best plain decoding here: it beats `hf`, transformers' `generate`, on the same
  model); `pld` is transformers' prompt-lookup decoding (not lossless on this target: it changes
  greedy tokens); `eagle` is EAGLE with the default tree (`auto+lookup`: a dynamic tree sized each
  round by the machine's cost curve, with prompt-lookup guesses grafted; at T > 0 one sampled
  draft a round on a CPU), `eagle@TREE` EAGLE with that tree at every temperature; `llamacpp` is
  llama.cpp's plain decoding of the same GGUF (with the `[llamacpp]` extra).
- **Timing**: one warm-up question per method, then methods interleaved question by question;
  tok/s is new tokens over wall time summed over questions (prefill included); speedup is against
  `vanilla` on the same questions. tau is tokens per verification round. "ceiling" is the speedup
  the same rounds would give if drafting and bookkeeping cost nothing (the target's forwards alone,
  prefill and verification, against vanilla's): what the head's acceptance and this CPU's cost per
  verified row allow, so a row's speedup over its ceiling is the share drafting leaves.
- **Lossless**: at T = 0 every EAGLE row's tokens are compared with vanilla's, question by question.
"""


def slug(kind: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")


def load(run: Path, stage: str) -> dict | None:
    """A stage's results; an `eaglespec bench` run's summary is recomputed from its records, so every
    table derives its columns (speedups, ceilings) the way this checkout defines them."""
    path = run / stage / "results.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    if result.get("records") and "methods" in result.get("config", {}):
        from eaglespec.bench.harness import summarize

        result["summary"] = summarize(result["records"], SimpleNamespace(methods=result["config"]["methods"]))
    return result


def fx(x: float | None, unit: str = "x", nd: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}{unit}"


def stamp(result: dict) -> str:
    m = result["machine"]
    return (f"{m['date']}, commit `{m.get('commit') or '?'}`, host `{m.get('host', '?')}`, {m['threads']} threads, "
            f"torch {m['torch']}, transformers {m['transformers']}")


def speed_tables(result: dict, title: str) -> list[str]:
    """One table per temperature: methods by dataset, each cell speedup (tok/s, tau, ceiling)."""
    cfg, rows = result["config"], result["summary"]
    out = [f"### {title}", "", f"`eaglespec bench` {stamp(result)}.", ""]
    datasets = [d for d in TITLES if any(r["dataset"] == d for r in rows)]
    for temp in sorted({r["temperature"] for r in rows}):
        out += [f"T = {temp:g}:", "", "| method | " + " | ".join(TITLES[d] for d in datasets) + " |",
                "|---|" + "---|" * len(datasets)]
        methods = list(dict.fromkeys(r["method"] for r in rows if r["temperature"] == temp))
        for method in methods:
            cells = []
            for d in datasets:
                r = next((r for r in rows if r["method"] == method and r["dataset"] == d and r["temperature"] == temp),
                         None)
                if r is None:
                    cells.append("")
                    continue
                extra = (f", tau {r['tau']:.2f}, ceiling {fx(r.get('free_draft_speedup'))}"
                         if method.startswith("eagle") and r.get("tau") else "")
                cells.append(f"{fx(r['speedup_vs_vanilla'])} ({r['tokens_per_s']:.0f} tok/s{extra})")
            label = {"eagle": f"eagle (`{cfg['tree']}`)", "eagle-chain": f"eagle (`{cfg['chain']}`)"}.get(method, method)
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
    eq = [r["greedy_equal"] for r in rows if r["temperature"] == 0 and r["greedy_equal"] is not None
          and r["method"].startswith("eagle")]
    if eq:
        out += [f"Greedy EAGLE output equals vanilla's on every question: **{'yes' if all(eq) else 'NO'}**.", ""]
    skipped = result.get("skipped") or {}
    if skipped:  # a method the run could not run is named, not silently missing
        out += ["Not run: " + "; ".join(f"`{m}`, {why}" for m, why in skipped.items()) + ".", ""]
    return out


def tau_table(result: dict, title: str = "Acceptance on all 80 MT-bench first turns (paper tree, T = 0)") -> list[str]:
    """tau and n-alpha (the acceptance rate of a draft at depth n + 1 given its parent accepted) per set."""
    rows = [r for r in result["summary"] if r["method"] == "eagle"]
    out = [f"### {title}", "", f"{stamp(result)}.", "",
           "| set | tree | tau | 0-α | 1-α | 2-α | 3-α | 4-α | tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        na = [fx(a, "") for a in (r.get("n_alpha") or [])[:5]] + [""] * 5
        out.append(f"| {TITLES.get(r['dataset'], r['dataset'])} | {result['config']['tree']} | {r['tau']:.3f} | "
                   + " | ".join(na[:5]) + f" | {r['new_tokens']} |")
    return out + [""]


def batch_table(result: dict) -> list[str]:
    out = [f"### Batch sizes (tree `{result.get('batch_tree')}`, paper Table 7)", "", f"{stamp(result)}.", "",
           "| dataset | T | batch | vanilla tok/s | eagle tok/s | speedup | tau | greedy = vanilla |",
           "|---|---|---|---|---|---|---|---|"]
    for r in result["batch_summary"]:
        eq = {True: "yes", False: "**NO**", None: "n/a"}[r["greedy_equal"]]
        out.append(f"| {TITLES.get(r['dataset'], r['dataset'])} | {r['temperature']:g} | {r['batch_size']} | "
                   f"{r['vanilla_tokens_per_s']:.1f} | {r['eagle_tokens_per_s']:.1f} | {fx(r['speedup'])} | "
                   f"{fx(r.get('tau'), '')} | {eq} |")
    return out + [""]


def curve_table(run: Path, kind: str, stage: str = "curve", target: str = "fp32 target") -> list[str]:
    path = run / stage / "cost_curve.json"
    if not path.is_file():
        return []
    c = json.loads(path.read_text())
    show = [n for n in (1, 2, 3, 4, 8, 16, 32, 64) if n in c["sizes"]]
    ms = {n: 1000 * t for n, t in zip(c["sizes"], c["verify_s"])}
    return [f"### Cost curve ({target}: one forward + LM head vs tokens verified)", "",
            f"{kind}, {c['machine'].get('threads')} threads, context {c['context']} tokens.", "",
            "| tokens | " + " | ".join(str(n) for n in show) + " | one draft level |",
            "|---|" + "---|" * (len(show) + 1),
            "| ms | " + " | ".join(f"{ms[n]:.1f}" for n in show) + f" | {1000 * c['draft_level_s']:.2f} |",
            "| x one token | " + " | ".join(f"{ms[n] / ms[show[0]]:.2f}" for n in show) + " | |", ""]


def serve_table(run: Path, result: dict) -> list[str]:
    cfg = result["config"]
    settings = "; ".join(f"{name}: `--max-batch {v['max_batch']}`" + (f" `--batch-tree {v['batch_tree']}`"
                                                                      if v["batch_tree"] else " `--batch-tree none`")
                         for name, v in cfg["settings"].items())
    out = ["### Concurrent clients (`eaglespec serve`)", "",
           f"`python -m eaglespec.bench.serving` {stamp(result)}.", "",
           f"{cfg['requests']} MT-bench first turns per cell (chat, {cfg['max_tokens']} tokens, T = {cfg['temperature']:g}), "
           f"sent by C clients that each ask again as soon as an answer comes; the server over one engine "
           f"(`--tree {cfg['tree']}`): {settings}. tok/s: every answer's tokens over the cell's wall time, median of "
           f"{cfg['repeats']} interleaved repeats; latency: send to full answer, queueing included.", "",
           "| clients | setting | tok/s | vs one at a time | p50 latency | p95 latency | greedy = vanilla |",
           "|---|---|---|---|---|---|---|"]
    order = list(cfg["settings"])
    for r in sorted(result["summary"], key=lambda r: (r["clients"], order.index(r["setting"]))):
        eq = {True: "yes", False: "**NO**", None: "n/a"}[r.get("greedy_equal")]
        out.append(f"| {r['clients']} | {r['setting']} | {r['tokens_per_s']:.1f} | {fx(r['vs_one_at_a_time'])} | "
                   f"{r['p50_latency_s']:.2f} s | {r['p95_latency_s']:.2f} s | {eq} |")
    image = picture(run, "serve/serving.png", "serving", result["machine"]["cpu"],
                    "aggregate tokens/s and p95 latency by clients")
    return out + ([""] + image if image else []) + [""]


def picture(run: Path, stage_file: str, prefix: str, kind: str, alt: str) -> list[str]:
    """The stage's PNG copied to docs/ under a per-host name, as a Markdown image line ([] if none)."""
    plot = run / stage_file
    if not plot.is_file():
        return []
    name = f"{prefix}_{slug(kind)}.png"
    DOCS.mkdir(exist_ok=True)
    shutil.copyfile(plot, DOCS / name)
    return [f"![{alt}](docs/{name})"]


def engines_table(run: Path, result: dict, stage: str = "engines", title: str = "") -> list[str]:
    from eaglespec.bench.engines import report

    model = result.get("model", "smollm2-135m-instruct")
    official = any(r["engine"].startswith("official") for r in result["rows"])
    heads = "official EAGLE: the eagle1 head; the others: the eagle3 head" if official else "the eagle3 head"
    fp32_engines = "official EAGLE and vLLM run" if official else "vLLM runs"
    out = [f"### {title or 'Engine against engine (the same heads in other EAGLE engines)'}", "",
           f"`python -m eaglespec.bench.engines --model {model}` (`scripts/benchmarks.sh` stage `{stage}`; the "
           "engines prepared by `scripts/engines.sh`): each engine's plain decoding and its EAGLE decoding with the "
           f"same head, exported to the engine's layout ({heads}). Each engine's EAGLE output is compared with its "
           f"own plain output; {fp32_engines} the fp32 target, llama.cpp the packaged GGUF "
           "(eaglespec's int4-q8 rows are its match).", "",
           *report(result).splitlines()]
    image = picture(run, f"{stage}/speedup.png", stage, result["machine"]["cpu"],
                    "tokens/s of each engine, plain and EAGLE")
    return out + ([""] + image if image else []) + [""]


def tables(section: str) -> list[list[str]]:
    """A host section's tables, each its lines from its `###` heading to the next heading."""
    return [("### " + block).rstrip().splitlines() + [""] for block in re.split(r"(?m)^### ", section)[1:]]


def host_section(run: Path, kept: dict[str, str] | None = None) -> tuple[str, str]:
    """This host's section from the run's stages; a table whose stage the run lacks is kept as this
    host's section in `kept` (the existing sections, by CPU kind) has it: each table carries its own
    run's stamp."""
    results = {s: load(run, s) for s in ("main", "int4-q8", "int4", "ablation", "batch", "tau80", "serve", "engines",
                                         "qwen-main", "qwen-int4-q8", "qwen-tau", "qwen-engines")}
    first = next((r for r in results.values() if r is not None), None)
    if first is None:
        sys.exit(f"no results.json under {run}")
    kind = first["machine"]["cpu"]
    old = tables((kept or {}).get(kind, ""))

    def table(ready: bool, heading: str, build) -> list[str]:
        if ready:
            return build()
        return next((t for t in old if t[0].startswith(f"### {heading}")), [])

    def speed(stage: str, title: str, plot: str = "", alt: str = "") -> list[str]:
        def build() -> list[str]:
            image = picture(run, f"{stage}/speedup.png", plot, kind, alt) if plot else []
            return speed_tables(results[stage], title) + image + ([""] if image else [])
        return table(results[stage] is not None, title, build)

    qwen = "Qwen2.5-Coder-0.5B-Instruct"
    lines = [f"<!-- host: {kind} -->", f"## {kind}", ""]
    lines += speed("main", "fp32 target (exact codes): the four sets", "bench_speedup",
                   f"speedup over vanilla, fp32 target, {kind}")
    lines += speed("int4-q8", "int4-q8 target (`--quantize fastest` with AVX512-VNNI)")
    lines += speed("int4", "int4 target (weight-only; `--quantize fastest` without AVX512)")
    lines += speed("ablation", "Which tree (MT-bench first turns, T = 0)")
    lines += table((run / "curve" / "cost_curve.json").is_file(), "Cost curve (fp32 target", lambda: curve_table(run, kind))
    batch = results["batch"]
    lines += table(bool(batch and batch.get("batch_summary")), "Batch sizes", lambda: batch_table(batch))
    lines += table(results["tau80"] is not None, "Acceptance on all 80", lambda: tau_table(results["tau80"]))
    lines += table(results["serve"] is not None, "Concurrent clients", lambda: serve_table(run, results["serve"]))
    lines += table(results["engines"] is not None, "Engine against engine", lambda: engines_table(run, results["engines"]))
    lines += speed("qwen-main", f"{qwen}, fp32 target (exact codes): the four sets", "bench_speedup_qwen",
                   f"speedup over vanilla, {qwen}, {kind}")
    lines += speed("qwen-int4-q8", f"{qwen}, int4-q8 target (`--quantize fastest`)")
    lines += table((run / "qwen-curve" / "cost_curve.json").is_file(), f"Cost curve ({qwen}",
                   lambda: curve_table(run, kind, "qwen-curve", f"{qwen}, fp32 target"))
    tau_title, engines_title = f"{qwen}: acceptance on the paper tree (T = 0)", f"{qwen}: engine against engine"
    lines += table(results["qwen-tau"] is not None, tau_title, lambda: tau_table(results["qwen-tau"], tau_title))
    lines += table(results["qwen-engines"] is not None, engines_title,
                   lambda: engines_table(run, results["qwen-engines"], "qwen-engines", engines_title))
    return kind, "\n".join(lines).rstrip() + "\n"


def headline(result: dict) -> list[str]:
    """The README's table: plain decoding and EAGLE's default on the four sets, with the host."""
    rows, m = result["summary"], result["machine"]
    datasets = [d for d in TITLES if any(r["dataset"] == d for r in rows)]

    def cell(d: str, method: str, temp: float, what: str) -> str:
        r = next((r for r in rows if r["method"] == method and r["dataset"] == d and r["temperature"] == temp), None)
        if r is None:
            return "n/a"
        if what == "tok/s":
            return f"{r['tokens_per_s']:.0f}"
        if what == "ceiling":
            return fx(r.get("free_draft_speedup"))
        return f"**{fx(r['speedup_vs_vanilla'])}** ({r['tokens_per_s']:.0f} tok/s, tau {r['tau']:.2f})"

    head = result.get("config", {}).get("head")  # the folder it ran: the shipped heads are named by theirs
    out = [f"{m['cpu']}, {m['threads']} threads, host `{m.get('host', '?')}`, {m['date']}, commit "
           f"`{m.get('commit') or '?'}`; fp32 target (exact codes)" + (f", head `{Path(head).name}`" if head else "")
           + ":", "",
           "| | " + " | ".join(TITLES[d] for d in datasets) + " |", "|---|" + "---|" * len(datasets)]
    for label, method, temp, what in (("plain decoding, tok/s", "vanilla", 0.0, "tok/s"),
                                      ("`transformers.generate`, tok/s", "hf", 0.0, "tok/s"),
                                      ("EAGLE, T = 0", "eagle", 0.0, "eagle"),
                                      ("EAGLE, T = 1", "eagle", 1.0, "eagle"),
                                      ("ceiling (drafting free), T = 0", "eagle", 0.0, "ceiling")):
        cells = [cell(d, method, temp, what) for d in datasets]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def sections(doc: str) -> dict[str, str]:
    """The per-host sections of an existing BENCHMARKS.md, by CPU kind."""
    parts = re.split(r"(?m)^(?=<!-- host: )", doc)
    out = {}
    for part in parts[1:]:
        kind = re.match(r"<!-- host: (.*?) -->", part).group(1)
        out[kind] = part.rstrip() + "\n"
    return out


def main() -> None:
    run = Path(sys.argv[1])
    doc_path = Path(sys.argv[2] if len(sys.argv) > 2 else Path(__file__).resolve().parents[1] / "BENCHMARKS.md")
    kept = sections(doc_path.read_text()) if doc_path.is_file() else {}
    kind, section = host_section(run, kept)
    kept[kind] = section
    doc_path.write_text(HEADER + "\n" + "\n".join(kept[k] for k in sorted(kept)))
    print(f"{doc_path}: section {kind!r} written; kept {sorted(k for k in kept if k != kind)}")
    main_result, readme = load(run, "main"), doc_path.parent / "README.md"
    if main_result and readme.is_file():
        text = readme.read_text()
        start, end = text.find("<!-- headline -->"), text.find("<!-- /headline -->")
        if 0 <= start < end:
            table = "\n".join(headline(main_result))
            readme.write_text(text[: start + len("<!-- headline -->")] + "\n" + table + "\n" + text[end:])
            print(f"{readme}: headline table written")


if __name__ == "__main__":
    main()
