"""One benchmark harness: every method in one process, question by question, interleaved, after warm-up.

Methods: ``vanilla`` (the engine's plain decoding, the baseline), ``eagle`` (chosen tree),
``eagle-chain`` (the paper's chain ablation), ``hf`` (``model.generate``), ``pld`` (transformers'
prompt-lookup decoding, greedy only), ``llamacpp`` / ``llamacpp-pld`` (llama.cpp on the same GGUF
file, plain and with its prompt-lookup draft: the absolute yardstick; it computes with quantized
weights, so its tokens are not expected to equal ours). Batch sizes > 1 get their own table:
vanilla vs eagle throughput with every sequence of a batch decoded together.
"""

from __future__ import annotations

import contextlib
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm import tqdm

from ..platform import cpu_has, cpu_kind
from ..models import Engine
from ..errors import EaglespecError
from ..io import atomic_write_json, atomic_write_text, short_path
from ..models import eos_ids
from ..cpu.quant import QUANTIZERS, target_kernels
from ..spec.verify import SamplingParams
from .datasets import load_questions

METHODS = ("vanilla", "eagle", "eagle-chain", "hf", "pld", "llamacpp", "llamacpp-pld")  # + eagle@TREE


def parse_methods(text: str) -> tuple[str, ...]:
    """Comma list; ``eagle@TREE`` is eagle with another tree (an ablation row), and the commas
    inside ``eagle@dynamic:5,4,16`` stay with it."""
    out: list[str] = []
    for tok in (t.strip() for t in text.split(",")):
        if tok and tok[0].isdigit() and out:
            out[-1] += "," + tok
        elif tok:
            out.append(tok)
    bad = [m for m in out if m not in METHODS and not m.startswith("eagle@")]
    if bad:
        raise EaglespecError(f"unknown method(s) {bad}; choose from {METHODS} or eagle@TREE")
    return tuple(out)
GREEDY_ONLY = {"pld": "transformers' prompt lookup is greedy-only here"}
NOT_OURS = {"llamacpp", "llamacpp-pld"}  # other numerics (quantized matmuls): no token equality expected


@contextlib.contextmanager
def _llama_params(**fields: Any) -> Iterator[None]:
    """Model parameters `Llama()` has no keyword for. `use_extra_bufts=False`: llama-cpp-python 0.3.36
    built on an AMX CPU puts SmolLM2's Q4_1 weights in the AMX buffer type, and its first decode
    segfaults there; without the extra (repacking) buffer types it runs (74 tok/s on 2 Xeon cores)."""
    import llama_cpp.llama_cpp as lib  # the ctypes module `Llama.__init__` calls

    default = lib.llama_model_default_params

    def patched():
        params = default()
        for k, v in fields.items():
            setattr(params, k, v)
        return params

    lib.llama_model_default_params = patched
    try:
        yield
    finally:
        lib.llama_model_default_params = default


@dataclass
class BenchConfig:
    model: str = "smollm2-135m-instruct"
    head: str | None = None
    draft_vocab: str = "context"  # which tokens the head may propose (EagleDraftHead.from_pretrained)
    datasets: tuple[str, ...] = ("mt_bench",)
    limit: int | None = None
    spread: bool = False  # limit's questions spaced evenly over the set, not its first ones
    temperatures: tuple[float, ...] = (0.0,)
    max_new_tokens: int = 128
    methods: tuple[str, ...] = ("vanilla", "eagle", "hf")
    tree: str = "paper"
    chain: str = "chain:5"
    seed: int = 0
    out: str = "bench_out"
    warmup: int = 1
    first_turn_only: bool = False
    quantize: str = "none"  # one of quant.QUANTIZERS: every method runs the same quantized target
    packed: bool | None = None  # every method runs the same target with pre-packed fp32 weights; None: auto
    compile: bool = False  # every method runs the same torch.compile'd target
    packed_kernel: str = ""  # set by run_bench: "skinny" / "skinny-avx2" (eaglespec's kernels) or "oneDNN"
    exact_codes: int = 0  # set by run_bench: fp32 layers stored as their exact codes (quant.ExactInt4Linear / ExactInt8Linear)
    batch_sizes: tuple[int, ...] = (1,)  # > 1: also the batch throughput table (vanilla vs eagle)
    extra: dict = field(default_factory=dict)


class Runner:
    def __init__(self, model, tok, head, cfg: BenchConfig):
        self.model, self.tok, self.cfg = model, tok, cfg
        self.eos = eos_ids(tok, model)
        self.engines = {"vanilla": Engine(model, None)}
        if head is not None:
            self.engines["eagle"] = Engine(model, head, tree=cfg.tree)
            self.engines["eagle-chain"] = Engine(model, head, tree=cfg.chain)
            # batches need one static tree shape for all rows
            self.batch_tree = cfg.tree if self.engines["eagle"].dynamic is None else "paper"
            self.engines["eagle-batch"] = Engine(model, head, tree=self.batch_tree)
        self.llama = {}

    def unavailable(self, method: str) -> str | None:
        """Why a method cannot run here (None if it can)."""
        if method in NOT_OURS:
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                return "llama-cpp-python is not installed (pip install 'eaglespec[llamacpp]'; builds from source, ~6 min)"
            from ..models import REGISTRY

            if self.cfg.model not in REGISTRY:
                return f"needs a GGUF file; {self.cfg.model!r} is not a registry model"
        if method.startswith("eagle") and "eagle" not in self.engines:
            return "needs a draft head"
        if method.startswith("eagle@") and method not in self.engines:
            # eagle@TREE: that tree at every temperature (`eagle` is the default engine's choice)
            self.engines[method] = Engine(self.model, self.engines["eagle"].head, tree=method.split("@", 1)[1],
                                          sampled_tree=None)
        return None

    def _llama(self, method: str):
        if method not in self.llama:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            from ..models import gguf_path

            draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if method == "llamacpp-pld" else None
            with _llama_params(use_extra_bufts=not cpu_has("amx_int8")):
                self.llama[method] = Llama(model_path=str(gguf_path(self.cfg.model)), n_ctx=4096,
                                           n_threads=torch.get_num_threads(), n_batch=512, draft_model=draft,
                                           seed=self.cfg.seed, verbose=False)
        return self.llama[method]

    def run_llamacpp(self, method: str, ids: list[int], sp: SamplingParams, seed: int) -> dict[str, Any]:
        llm = self._llama(method)
        llm.reset()
        llm.set_seed(seed)
        toks: list[int] = []
        t0 = time.perf_counter()
        for t in llm.generate(ids, temp=sp.temperature, top_p=sp.top_p, top_k=sp.top_k or 0, min_p=0.0,
                              repeat_penalty=1.0, reset=True):
            toks.append(int(t))
            if t in self.eos or len(toks) >= self.cfg.max_new_tokens:
                break
        return {"token_ids": toks, "new_tokens": len(toks), "time_s": time.perf_counter() - t0}

    def run_batch(self, method: str, prompts: list[list[int]], sp: SamplingParams, seed: int) -> dict[str, Any]:
        eng = self.engines["vanilla" if method == "vanilla" else "eagle-batch"]
        t0 = time.perf_counter()
        outs = eng.generate_batch(prompts, self.cfg.max_new_tokens, sp, "vanilla" if method == "vanilla" else "eagle",
                                  seed, self.eos)
        dt = time.perf_counter() - t0
        # rows share every round while they live, so the longest-lived row's times are the batch's
        return {"token_ids": [o.token_ids for o in outs], "new_tokens": sum(o.stats.new_tokens for o in outs),
                "time_s": dt, "rounds": max(o.stats.rounds for o in outs),
                "accepted": sum(sum(o.stats.accept_lengths) for o in outs),
                "row_rounds": sum(o.stats.rounds for o in outs), "rows": len(outs),
                "draft_time_s": max(o.stats.draft_time_s for o in outs),
                "verify_time_s": max(o.stats.verify_time_s for o in outs)}

    def run(self, method: str, ids: list[int], sp: SamplingParams, seed: int) -> dict[str, Any]:
        n = self.cfg.max_new_tokens
        if method in NOT_OURS:
            return self.run_llamacpp(method, ids, sp, seed)
        if method in ("vanilla", "eagle", "eagle-chain") or method.startswith("eagle@"):
            eng = self.engines.get(method)
            if eng is None:
                raise EaglespecError(f"method {method!r} needs a draft head")
            out = eng.generate(ids, n, sp, "vanilla" if method == "vanilla" else "eagle", seed, self.eos)
            s = out.stats
            return {"token_ids": out.token_ids, "new_tokens": s.new_tokens, "time_s": s.time_s,
                    "rounds": s.rounds, "accepted": sum(s.accept_lengths), "draft_time_s": s.draft_time_s,
                    "verify_time_s": s.verify_time_s, "prefill_time_s": s.prefill_time_s,
                    "alpha_accepted": s.alpha_accepted, "alpha_total": s.alpha_total}
        kwargs: dict[str, Any] = dict(max_new_tokens=n, eos_token_id=self.eos, pad_token_id=self.eos[0],
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      repetition_penalty=None)
        if sp.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k or None)
        if method == "pld":
            kwargs["prompt_lookup_num_tokens"] = 10
        elif method != "hf":
            raise EaglespecError(f"unknown method {method!r}; choose from {METHODS}")
        torch.manual_seed(seed)
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            y = self.model.generate(x, **kwargs)
        dt = time.perf_counter() - t0
        toks = y[0, len(ids):].tolist()
        return {"token_ids": toks, "new_tokens": len(toks), "time_s": dt}


def _chat_ids(tok, history: list[dict]) -> list[int]:
    return tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True)


def run_bench(cfg: BenchConfig) -> dict:
    from ..spec.head import EagleDraftHead
    from ..models import load_target

    widest = max(cfg.batch_sizes, default=1)
    for ds in cfg.datasets if widest > 1 else []:  # before any model loads: a batch needs that many questions
        n = len(load_questions(ds, cfg.limit, cfg.spread))
        if n < widest:
            raise EaglespecError(f"--batch-size {widest} needs {widest} questions per set; {ds} gives {n}"
                                 + (" (raise --limit)" if cfg.limit else ""))
    model, tok = load_target(cfg.model, quantize=cfg.quantize, packed=cfg.packed, compile=cfg.compile)
    done = target_kernels(model)
    cfg.packed = done.packed  # what `None` (auto) chose
    cfg.packed_kernel = done.packed_kernel or ""  # fp32 packed or int4: which kernel
    cfg.exact_codes = done.exact_codes  # fp32 layers streamed as their exact codes
    head = EagleDraftHead.from_pretrained(cfg.head, model, draft_vocab=cfg.draft_vocab) if cfg.head else None
    runner = Runner(model, tok, head, cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    skipped: dict[str, str] = {}
    runnable = []
    for m in cfg.methods:
        why = runner.unavailable(m)
        if why:
            skipped[m] = why
        else:
            runnable.append(m)
    # warm-up: every method once, untimed
    warm_ids = _chat_ids(tok, [{"role": "user", "content": "Say hello."}])
    for m in runnable:
        for _ in range(cfg.warmup):
            runner.run(m, warm_ids, SamplingParams(), 0)
    records: list[dict] = []
    batch_records: list[dict] = []
    for temp in cfg.temperatures:
        sp = SamplingParams(temperature=temp)
        methods = [m for m in runnable if not (temp > 0 and m in GREEDY_ONLY)]
        for m in set(runnable) - set(methods):
            skipped[f"{m}@T={temp}"] = GREEDY_ONLY[m]
        for ds in cfg.datasets:
            questions = load_questions(ds, cfg.limit, cfg.spread)
            bar = tqdm(questions, desc=f"{ds} T={temp}", unit="q", dynamic_ncols=True)
            tok_done, t_done = 0, 0.0
            for qi, q in enumerate(bar):
                order = methods if qi % 2 == 0 else methods[::-1]  # A B, then B A
                for m in order:
                    history: list[dict] = []
                    turns = q["turns"][:1] if cfg.first_turn_only else q["turns"]
                    for turn_i, turn in enumerate(turns):
                        history.append({"role": "user", "content": turn})
                        ids = _chat_ids(tok, history)
                        r = runner.run(m, ids, sp, cfg.seed + qi * 7 + turn_i)
                        history.append({"role": "assistant",
                                        "content": tok.decode(r["token_ids"], skip_special_tokens=True)})
                        records.append({"dataset": ds, "temperature": temp, "question_id": q["question_id"],
                                        "category": q.get("category", ""), "turn": turn_i, "method": m,
                                        "prompt_tokens": len(ids), **r})
                        if m == "vanilla":
                            tok_done += r["new_tokens"]
                            t_done += r["time_s"]
                bar.set_postfix(vanilla_tok_s=f"{tok_done / max(t_done, 1e-9):.1f}")
            bar.close()
            atomic_write_json({"config": cfg.__dict__, "records": records}, out / "results.json")
            batch_records += run_batches(runner, tok, questions, ds, temp, sp, [m for m in ("vanilla", "eagle")
                                                                                  if m in runnable])
    check_equality(records)
    summary = summarize(records, cfg)
    result = {"config": {k: v for k, v in cfg.__dict__.items()}, "machine": machine(), "skipped": skipped,
              "summary": summary, "records": records, "batch_summary": summarize_batches(batch_records),
              "batch_records": batch_records,
              "batch_tree": getattr(runner, "batch_tree", None)}
    write_run(out, result, report_markdown(result), "report.md", lambda png: plot_speedups(summary, png), "speedup.png")
    return result


def run_batches(runner: Runner, tok, questions: list[dict], ds: str, temp: float, sp: SamplingParams,
                methods: list[str]) -> list[dict]:
    """Paper Table 7: first turns in batches of B, vanilla and eagle interleaved per batch."""
    recs: list[dict] = []
    for bs in runner.cfg.batch_sizes:
        if bs <= 1 or len(methods) < 2:
            continue
        prompts = [_chat_ids(tok, [{"role": "user", "content": q["turns"][0]}]) for q in questions]
        groups = [prompts[i:i + bs] for i in range(0, len(prompts) - bs + 1, bs)]
        runner.run_batch("eagle", groups[0], sp, 0)  # warm-up at this batch shape
        for gi, group in enumerate(tqdm(groups, desc=f"{ds} T={temp} batch {bs}", unit="batch", dynamic_ncols=True)):
            for m in (methods if gi % 2 == 0 else methods[::-1]):
                r = runner.run_batch(m, group, sp, runner.cfg.seed + gi)
                recs.append({"dataset": ds, "temperature": temp, "batch_size": bs, "batch": gi, "method": m, **r})
    base = {(r["dataset"], r["temperature"], r["batch_size"], r["batch"]): r["token_ids"] for r in recs
            if r["method"] == "vanilla" and r["temperature"] == 0}
    for r in recs:
        key = (r["dataset"], r["temperature"], r["batch_size"], r["batch"])
        if r["method"] != "vanilla" and key in base:
            r["equal_to_vanilla"] = r["token_ids"] == base[key]
    return recs


def summarize_batches(recs: list[dict]) -> list[dict]:
    rows = []
    for key in sorted({(r["dataset"], r["temperature"], r["batch_size"]) for r in recs}):
        rs = [r for r in recs if (r["dataset"], r["temperature"], r["batch_size"]) == key]
        row = {"dataset": key[0], "temperature": key[1], "batch_size": key[2]}
        for m in ("vanilla", "eagle"):
            mr = [r for r in rs if r["method"] == m]
            t, rounds = sum(r["time_s"] for r in mr), sum(r["rounds"] for r in mr)
            row[f"{m}_tokens_per_s"] = sum(r["new_tokens"] for r in mr) / t if t else None
            row[f"{m}_ms_per_round"] = 1e3 * t / rounds if rounds else None
            # occupancy: the share of the batch's row slots still decoding; a batch runs until its
            # slowest row is done, so rows that finish early leave the rounds after them part-empty
            slots = sum(r["rounds"] * r["rows"] for r in mr)
            row[f"{m}_occupancy"] = sum(r["row_rounds"] for r in mr) / slots if slots else None
            if t:
                dt, vt = sum(r["draft_time_s"] for r in mr), sum(r["verify_time_s"] for r in mr)
                row[f"{m}_time_split"] = {"draft": dt / t, "verify": vt / t, "other": 1 - (dt + vt) / t}
        er = [r for r in rs if r["method"] == "eagle"]
        rr = sum(r["row_rounds"] for r in er)
        eq = [r["equal_to_vanilla"] for r in er if "equal_to_vanilla" in r]
        v, e = row["vanilla_tokens_per_s"], row["eagle_tokens_per_s"]
        rows.append({**row, "batches": len(er), "speedup": e / v if v and e else None,
                     "tau": sum(r["accepted"] for r in er) / rr if rr else None,
                     "greedy_equal": all(eq) if eq else None})
    return rows


def check_equality(records: list[dict]) -> None:
    """At temperature 0 every method must produce vanilla's tokens; marks each record."""
    base = {(r["dataset"], r["question_id"], r["turn"]): r["token_ids"] for r in records
            if r["method"] == "vanilla" and r["temperature"] == 0}
    for r in records:
        key = (r["dataset"], r["question_id"], r["turn"])
        if r["temperature"] == 0 and key in base and r["method"] not in NOT_OURS:
            r["equal_to_vanilla"] = r["token_ids"] == base[key]


def summarize(records: list[dict], cfg: BenchConfig) -> list[dict]:
    rows = []
    groups = sorted({(r["dataset"], r["temperature"]) for r in records})
    for ds, temp in groups:
        recs = [r for r in records if r["dataset"] == ds and r["temperature"] == temp]
        by_method = {m: [r for r in recs if r["method"] == m] for m in cfg.methods}

        def tps(rs):
            t = sum(r["time_s"] for r in rs)
            return sum(r["new_tokens"] for r in rs) / t if t else 0.0

        def per_q(rs):
            return {(r["question_id"], r["turn"]): r["new_tokens"] / r["time_s"] for r in rs if r["time_s"] > 0}

        def decode_tps(rs):  # after the prefill (which made the first token): None where it is not timed
            if not rs or any("prefill_time_s" not in r for r in rs):
                return None
            t = sum(r["time_s"] - r["prefill_time_s"] for r in rs)
            return sum(r["new_tokens"] - 1 for r in rs) / t if t > 0 else None

        def target_tps(rs, prefill: bool):  # the same tokens over the target's forwards alone (the prompt's too
            # when `prefill`): what drafting and the loop's bookkeeping cost left out
            keys = ("verify_time_s", "prefill_time_s") if prefill else ("verify_time_s",)
            if not rs or any(k not in r for r in rs for k in keys):
                return None
            t = sum(r[k] for r in rs for k in keys)
            return sum(r["new_tokens"] - (0 if prefill else 1) for r in rs) / t if t > 0 else None

        base_v, base_h = tps(by_method.get("vanilla", [])), tps(by_method.get("hf", []))
        base_d = decode_tps(by_method.get("vanilla", []))
        base_f = {p: target_tps(by_method.get("vanilla", []), p) for p in (True, False)}
        pq_v = per_q(by_method.get("vanilla", []))
        for m, rs in by_method.items():
            if not rs:
                continue
            row = {"dataset": ds, "temperature": temp, "method": m, "questions": len({r["question_id"] for r in rs}),
                   "new_tokens": sum(r["new_tokens"] for r in rs), "time_s": sum(r["time_s"] for r in rs),
                   "tokens_per_s": tps(rs)}
            row["speedup_vs_vanilla"] = row["tokens_per_s"] / base_v if base_v else None
            row["speedup_vs_hf"] = row["tokens_per_s"] / base_h if base_h else None
            d = decode_tps(rs)
            row["decode_speedup_vs_vanilla"] = d / base_d if d and base_d else None  # the prompt's share left out
            # the ceiling of this method's trees on this target: its speedup if drafting and the loop's
            # bookkeeping (vanilla's too) cost nothing, i.e. the target's forwards against acceptance alone;
            # with the prefill it bounds `speedup_vs_vanilla`, without it `decode_speedup_vs_vanilla`
            for key, p in (("free_draft_speedup", True), ("free_draft_decode_speedup", False)):
                f = target_tps(rs, p)
                row[key] = f / base_f[p] if f and base_f[p] else None
            ratios = [v / pq_v[k] for k, v in per_q(rs).items() if k in pq_v and pq_v[k] > 0]
            row["median_ratio_vs_vanilla"] = statistics.median(ratios) if ratios else None
            if "rounds" in rs[0]:
                rounds = sum(r["rounds"] for r in rs)
                row["tau"] = sum(r["accepted"] for r in rs) / rounds if rounds else None
                n = max(len(r["alpha_total"]) for r in rs)
                acc_ = [sum(r["alpha_accepted"][i] for r in rs if i < len(r["alpha_accepted"])) for i in range(n)]
                tot_ = [sum(r["alpha_total"][i] for r in rs if i < len(r["alpha_total"])) for i in range(n)]
                row["n_alpha"] = [a / t if t else None for a, t in zip(acc_, tot_)]
                dt, vt = sum(r["draft_time_s"] for r in rs), sum(r["verify_time_s"] for r in rs)
                row["time_split"] = {"draft": dt / row["time_s"], "verify": vt / row["time_s"],
                                     "other": 1 - (dt + vt) / row["time_s"]}
            eq = [r.get("equal_to_vanilla") for r in rs if "equal_to_vanilla" in r]
            row["greedy_equal"] = (all(eq) if eq else None)
            rows.append(row)
    return rows


def commit() -> str:
    """The eaglespec checkout's commit ("-dirty" with uncommitted changes), or "" outside git."""
    repo = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    if head.returncode:
        return ""
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def write_run(out: Path, result: dict, markdown: str, md_name: str, draw: Any, png_name: str) -> None:
    """A benchmark's folder: results.json, its Markdown table and its picture (`draw(result_part, path)`)."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(result, out / "results.json")
    atomic_write_text(markdown, out / md_name)
    draw(out / png_name)


def machine() -> dict:
    """Where and on what a benchmark ran: every published number names its host."""
    import transformers

    return {"cpu": cpu_kind(), "host": platform.node(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "commit": commit(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _f(x, nd=2, pct=False, unit=""):
    if x is None:
        return "n/a"
    return f"{100 * x:.0f}%" if pct else f"{x:.{nd}f}{unit}"


def report_markdown(result: dict) -> str:
    cfg, mach = result["config"], result["machine"]
    packed = f" ({cfg.get('packed_kernel') or 'oneDNN'} pre-packed)" if cfg.get("packed") else ""
    if cfg.get("packed") and cfg.get("exact_codes"):
        packed = f" ({cfg['exact_codes']} layers as their exact 4- and 8-bit codes, {cfg.get('packed_kernel')})"
    if cfg.get("quantize") == "int4":
        kernel = cfg.get("packed_kernel") or ""
        packed = (f" (eaglespec's 4-bit kernel{', AVX2' if kernel.endswith('avx2') else ''})"
                  if kernel.startswith("skinny") else " (torch's int4 kernel)")
    elif cfg.get("quantize") == "bf16":
        packed = f" (eaglespec's bf16 kernel{', AVX2' if (cfg.get('packed_kernel') or '').endswith('avx2') else ''})"
    elif cfg.get("quantize") in ("bf16-dot", "int4-dot"):
        packed = " (bf16 inputs too: eaglespec's AVX512-BF16 kernel)"
    elif cfg.get("quantize") == "int4-q8":
        packed = " (int8 inputs per 32: eaglespec's AVX512-VNNI kernel)"
    vocab = {"full": " (full draft vocabulary)", "head": " (the head's draft vocabulary, no context tokens)"}.get(
        cfg.get("draft_vocab"), "")
    lines = ["# eaglespec benchmark", "",
             f"- model: `{cfg['model']}`, head: `{short_path(cfg['head']) if cfg['head'] else None}`{vocab}, tree: `{cfg['tree']}`, chain: `{cfg['chain']}`, "
             f"max_new_tokens: {cfg['max_new_tokens']}, limit: {cfg['limit']}{' (spread)' if cfg.get('spread') else ''}, target weights: "
             f"{cfg.get('quantize') if cfg.get('quantize') in QUANTIZERS else 'fp32'}{packed}{', torch.compile' if cfg.get('compile') else ''}",
             f"- machine: {mach['cpu']}, {mach['threads']} threads (host {mach.get('host', '?')}); torch {mach['torch']}, "
             f"transformers {mach['transformers']}; {mach['date']}, commit {mach.get('commit') or '?'}", ""]
    for (ds, temp) in sorted({(r["dataset"], r["temperature"]) for r in result["summary"]}):
        lines += [f"## {ds}, temperature {temp}", "",
                  "| method | tok/s | speedup vs vanilla | vs hf | median per-question | after prefill | if drafting were free | tau | 0-α | 1-α | 2-α | 3-α | 4-α | draft / verify / other | tokens | greedy = vanilla |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["summary"]:
            if r["dataset"] != ds or r["temperature"] != temp:
                continue
            na = (r.get("n_alpha") or []) + [None] * 5
            split = r.get("time_split")
            split_s = "/".join(_f(split[k], pct=True) for k in ("draft", "verify", "other")) if split else "n/a"
            eq = {True: "yes", False: "**NO**", None: "n/a"}[r["greedy_equal"]]
            lines.append(f"| {r['method']} | {_f(r['tokens_per_s'], 1)} | {_f(r['speedup_vs_vanilla'], unit='x')} | "
                         f"{_f(r['speedup_vs_hf'], unit='x')} | {_f(r['median_ratio_vs_vanilla'], unit='x')} | "
                         f"{_f(r.get('decode_speedup_vs_vanilla'), unit='x')} | "
                         f"{_f(r.get('free_draft_speedup'), unit='x')} | {_f(r.get('tau'))} | "
                         + " | ".join(_f(a) for a in na[:5]) + f" | {split_s} | {r['new_tokens']} | {eq} |")
        lines.append("")
    if result.get("batch_summary"):
        lines += [f"## batch sizes (eagle tree `{result.get('batch_tree')}`)", "",
                  "| dataset | T | batch size | batches | vanilla tok/s | eagle tok/s | speedup | tau | ms/round "
                  "(vanilla / eagle) | occupancy (vanilla / eagle) | eagle draft / verify / other | greedy = vanilla |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["batch_summary"]:
            eq = {True: "yes", False: "**NO**", None: "n/a"}[r["greedy_equal"]]
            split = r.get("eagle_time_split")
            split_s = "/".join(_f(split[k], pct=True) for k in ("draft", "verify", "other")) if split else "n/a"
            lines.append(f"| {r['dataset']} | {r['temperature']} | {r['batch_size']} | {r['batches']} | "
                         f"{_f(r['vanilla_tokens_per_s'], 1)} | {_f(r['eagle_tokens_per_s'], 1)} | {_f(r['speedup'], unit='x')} | "
                         f"{_f(r['tau'])} | {_f(r.get('vanilla_ms_per_round'), 1)} / {_f(r.get('eagle_ms_per_round'), 1)} | "
                         f"{_f(r.get('vanilla_occupancy'), pct=True)} / {_f(r.get('eagle_occupancy'), pct=True)} | "
                         f"{split_s} | {eq} |")
        lines.append("")
    for k, why in result["skipped"].items():
        lines.append(f"- `{k}` not run: {why}")
    lines.append("")
    return "\n".join(lines)


def plot_speedups(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["dataset"], r["temperature"]) for r in summary})
    methods = list(dict.fromkeys(r["method"] for r in summary))
    # ~0.2 inch per bar, within a page's width: 8 cells of 8 methods stay readable
    fig, ax = plt.subplots(figsize=(min(16, max(6, 0.2 * len(groups) * len(methods) + 2)), 4.5))
    w = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        ys = [next((r["speedup_vs_vanilla"] or 0 for r in summary if (r["dataset"], r["temperature"]) == g
                    and r["method"] == m), 0) for g in groups]
        ax.bar([x + i * w for x in range(len(groups))], ys, w, label=m)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([x + w * (len(methods) - 1) / 2 for x in range(len(groups))])
    ax.set_xticklabels([f"{d}\nT={t}" for d, t in groups], fontsize=8)
    ax.set_ylabel("speedup vs vanilla (tokens/s ratio)")
    top = max((r["speedup_vs_vanilla"] or 0 for r in summary), default=1.0)
    ax.set_ylim(0, 1.25 * max(top, 1.0))  # room for the legend above the bars
    ax.legend(fontsize=7, ncol=min(len(methods), 8), loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
