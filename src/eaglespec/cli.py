"""``eaglespec generate | chat | serve | regenerate | extract | train | bench | profile | export`` — parses arguments and calls the library, nothing more.

Bad input ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from .errors import EaglespecError
from .platform import default_head, unsupported_transformers

QUANTIZERS = ("int8", "int4", "bf16", "bf16-dot", "int4-dot", "int4-q8")  # quant.QUANTIZERS, named here so that --help needs no torch


def check_device(device: str) -> None:
    """--device: "cpu", or "cuda[:N]" where CUDA has that device."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise EaglespecError(f"--device must be cpu or cuda[:N], got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise EaglespecError(f"--device must be cpu or cuda[:N], got {device!r}")
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise EaglespecError(f"--device {device} asked for, but CUDA has no such device here")


PACK_HELP = ("fp32 weights pre-packed (CPU) for eaglespec's AVX-512 / AVX2 kernel, or oneDNN's without them: the "
             "same model, streamed once per forward however many tokens a tree sends; every method uses it. "
             "Default: on where eaglespec's kernel runs (x86-64 with AVX-512 or AVX2), where it is as fast or "
             "faster at every tree size; `eaglespec profile --packed` measures yours")
COMPILE_HELP = ("torch.compile the target's decoder (every method uses it; ~10 minutes of compilation per "
                "process on 2 cores). With eaglespec's kernels (--packed, --quantize int4) inductor fuses "
                "the small ops around them; a compiled target is its own vanilla")
QUANT_HELP = ("int8 | int4 | bf16: weight-only quantized target (every method, vanilla included, runs the same "
              "quantized model; int4 and bf16 run on eaglespec's kernels); bf16-dot / int4-dot: bf16 / int4 weights and "
              "bf16-rounded inputs to each linear layer (CPUs with AVX512-BF16; cheaper trees than bf16 / int4); "
              "int4-q8: int4 weights and inputs quantized to int8 per 32, as "
              "llama.cpp's Q4 x Q8 (CPUs with AVX512-VNNI; the fastest here); fastest: int4-q8 where the CPU has "
              "AVX512-VNNI, else int4-dot where it has AVX512-BF16, else int4")
DRAFT_VOCAB_HELP = ("context (default): the tokens the head was trained to propose (the shipped SmolLM2 head: the "
                    "16k most frequent) plus those of the prompt and the text so far; head: the trained ones only; "
                    "full: every target token, with no retraining (about the acceptance of context, at 3x the "
                    "draft LM head's cost on a CPU)")
TREE_HELP = ("paper (EAGLE's 25-node tree) | chain:K | dynamic[:DEPTH,TOP_K,TOTAL] (EAGLE-2) | "
             "auto (dynamic, sized each round by this machine's cost curve); append +lookup[:L] to graft up "
             "to L (default 8) prompt-lookup tokens onto every tree (batch size 1). Default: auto+lookup on a "
             "CPU (at temperature > 0 one sampled draft a round there: see --sampled-tree), paper elsewhere")


def default_tree(device: str) -> str:
    """The tree when --tree is not given. On a CPU every verified token costs arithmetic and the
    paper's 25-node tree costs several steps, so `auto` sizes each round by the machine's cost curve;
    a GPU verifies the paper's tree for about the price of a step (the paper's setting)."""
    return "auto+lookup" if device.split(":")[0] == "cpu" else "paper"


def _add_head(p: argparse.ArgumentParser) -> None:
    """Which draft head, and which tokens it may propose: --head, --draft-vocab."""
    from .spec.head import DRAFT_VOCABS

    p.add_argument("--head", default=None, help="draft head folder or hub id (default: the head shipped for --model; "
                   "eagle1 / eagle3 / hybrid: its shipped head of that architecture)")
    p.add_argument("--draft-vocab", choices=DRAFT_VOCABS, default="context", help=DRAFT_VOCAB_HELP)


def _add_target_kernels(p: argparse.ArgumentParser) -> None:
    """How the target runs (every method of a command uses the same): --quantize, --packed, --compile."""
    p.add_argument("--quantize", choices=["none", "fastest", *QUANTIZERS], default="none", help=QUANT_HELP)
    p.add_argument("--packed", action=argparse.BooleanOptionalAction, default=None, help=PACK_HELP)
    p.add_argument("--compile", action="store_true", help=COMPILE_HELP)


def _add_export(sub: argparse._SubParsersAction) -> None:
    from .spec.formats import LAYOUTS

    p = sub.add_parser("export", help="write a draft head in another engine's layout (official EAGLE, "
                       "SafeAILab EAGLE-3, speculators / vLLM, GGUF / llama.cpp)")
    p.add_argument("head", help="the head folder (any layout eaglespec reads), a hub repo id in the local cache, "
                   "or eagle1 / eagle3 / hybrid: the head of that architecture shipped for --model")
    p.add_argument("--format", required=True, choices=[*LAYOUTS, "gguf"],
                   help="eagle1: official EAGLE (eagle-llm); eagle3: SafeAILab EAGLE-3 (SGLang reads it too); "
                        "speculators: vLLM's; gguf: llama.cpp's EAGLE-3 (runs llama.cpp's converter)")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--model", default="smollm2-135m-instruct", help="the head's target")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure this machine's cost curve (target forward vs tokens verified)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    _add_head(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    _add_target_kernels(p)
    p.add_argument("--out", default=None, help="also write cost_curve.json / .png here")
    p.add_argument("--compare", nargs="+", metavar="LABEL=JSON", default=None,
                   help="measure nothing: overlay saved cost_curve.json files in one PNG (--out DIR)")


def _add_engine(p: argparse.ArgumentParser) -> None:
    """The model and how it decodes (generate and serve): --model, the head, --method, --tree, the kernels."""
    p.add_argument("--model", default="smollm2-135m-instruct")
    _add_head(p)
    p.add_argument("--method", choices=["eagle", "vanilla"], default="eagle")
    p.add_argument("--tree", default=None, help=TREE_HELP)
    p.add_argument("--draft-sampling", choices=["topk", "sample"], default="sample",
                   help="at temperature > 0: children are the head's top-k (q one-hot) or sampled from it")
    p.add_argument("--sampled-tree", default="default", metavar="TREE",
                   help="the tree at temperature > 0: 'default' = chain:1 where --tree is auto[+lookup] on a CPU (one "
                        "sampled draft a round measured faster than any sampled tree auto grew), else --tree; "
                        "'same' = --tree; or any --tree value")
    p.add_argument("--device", default="cpu")
    _add_target_kernels(p)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with EAGLE (or vanilla) decoding")
    _add_engine(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--system", default=None)
    p.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text, no chat template")
    _add_sampling(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat in the terminal: each line you type is a turn, answers stream as they come")
    _add_engine(p)
    p.add_argument("--system", default=None)
    _add_sampling(p)
    p.add_argument("--stats", action="store_true", help="after each answer, print tau and tokens/s to stderr")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)")
    _add_engine(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the address is printed)")
    p.add_argument("--model-id", default=None, help="the name clients send as `model` (default: --model)")
    p.add_argument("--api-key", default=None, help="require this key as a Bearer token on every request but /health "
                   "(default: $EAGLESPEC_API_KEY; none: anyone who reaches the address may use the model)")
    p.add_argument("--max-tokens", type=int, default=1024, help="max_tokens of a request that gives none")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together, at most (continuous "
                   "batching: each round one target forward for all of them)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait beyond those; more are "
                   "answered 503 with Retry-After")
    p.add_argument("--batch-tree", default="chain:1", metavar="TREE",
                   help="what several running requests draft: a static tree (paper, chain:K) or 'none' for plain "
                        "batched steps (default chain:1: one draft a round, measured fastest with 4 and 8 clients on "
                        "a CPU; BENCHMARKS.md has the concurrency table). One running request drafts with --tree")


def _add_extract(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("extract", help="compute target features for training (resumable)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--data", default="sharegpt", help="sharegpt | FILE.jsonl with {'conversations': [...]}")
    p.add_argument("--out", required=True)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=1_000_000)
    p.add_argument("--heldout", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--aux-layers", default="auto", help="also store these target layers' hidden states, for a head "
                   "that fuses them (EAGLE-3's, the default arch of train): auto = EAGLE-3's layers 2, L // 2, L - 3 "
                   "of a target deep enough; a list such as 3,15,27 (0 = the embeddings); none")
    p.add_argument("--aux-only", action="store_true", help="only add the --aux-layers files to the shards already "
                   "in --out (from an earlier extract or regenerate --features-out)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the target's dtype while extracting (bfloat16: faster on CPUs with bf16 matrix units)")


def _field_comments(cls: type) -> dict[str, str]:
    """A config dataclass's field comments (`name: type = default  # what it is`, continued on the
    comment lines below it), as each option's --help text: the dataclass stays the one place that
    says what a setting means."""
    import inspect

    notes: dict[str, str] = {}
    name = None
    for line in inspect.getsource(cls).splitlines():
        field = re.match(r"\s+(\w+): [^#]*?(?:#\s*(.*))?$", line)
        if field and not line.lstrip().startswith("#"):
            name = field.group(1)
            if field.group(2):
                notes[name] = field.group(2)
        elif line.lstrip().startswith("#") and name in notes:
            notes[name] += " " + line.lstrip()[1:].strip()
        else:
            name = None
    return {k: v.replace("%", "%%") for k, v in notes.items()}


def _add_fields(p: argparse.ArgumentParser, defaults: object, skip: tuple[str, ...]) -> None:
    """One --option per field of a config dataclass, with its default and its comment as help."""
    from dataclasses import fields

    notes = _field_comments(type(defaults))
    for f in fields(defaults):  # type: ignore[arg-type]
        if f.name not in skip:
            val = getattr(defaults, f.name)
            extra = dict(f.metadata)  # choices, help
            if "help" not in extra and f.name in notes:
                extra["help"] = notes[f.name]
            if isinstance(val, bool):  # type=bool would read "--x False" as True
                p.add_argument("--" + f.name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=val,
                               **extra)
            else:
                p.add_argument("--" + f.name.replace("_", "-"), type=type(val), default=val, **extra)


def _config_from(a: argparse.Namespace, cls: type):
    """The config dataclass `cls` filled from parsed arguments (the inverse of `_add_fields`)."""
    from dataclasses import fields

    return cls(**{f.name: getattr(a, f.name) for f in fields(cls)})


def _add_regenerate(sub: argparse._SubParsersAction) -> None:
    from .train.regenerate import RegenerateConfig

    p = sub.add_parser("regenerate", help="self-distillation data: the target answers the training prompts (resumable)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--out", required=True, help="FILE.jsonl (appended; a rerun skips what is done)")
    _add_fields(p, RegenerateConfig(model="", out=""), ("model", "out"))


def _add_train(sub: argparse._SubParsersAction) -> None:
    from .train.trainer import TrainConfig

    p = sub.add_parser("train", help="train a draft head on extracted features (resumes by default)")
    p.add_argument("--features", required=True, help="an extract folder, or several joined by commas "
                   "(their train splits are pooled; the held-out split is the first folder's)")
    p.add_argument("--out", required=True)
    _add_fields(p, TrainConfig(features="", out=""), ("features", "out"))
    p.add_argument("--no-resume", action="store_true", help="start over even if --out holds a checkpoint")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="interleaved speed / acceptance benchmark against vanilla and peers")
    p.add_argument("--model", default="smollm2-135m-instruct")
    _add_head(p)
    p.add_argument("--dataset", default="mt_bench", help="comma list: mt_bench,humaneval,gsm8k,alpaca or FILE.jsonl")
    p.add_argument("--limit", type=int, default=None, help="this many questions per set (the first ones)")
    p.add_argument("--spread", action="store_true",
                   help="--limit's questions spaced evenly over each set (MT-bench: every category), not its first")
    p.add_argument("--temperature", default="0", help="comma list, e.g. 0,1")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default="vanilla,eagle,eagle-chain,hf,pld",
                   help="comma list of vanilla,eagle,eagle-chain,hf,pld,llamacpp,llamacpp-pld and eagle@TREE "
                        "(an eagle row with another tree, e.g. eagle@auto, eagle@dynamic:5,4,16)")
    p.add_argument("--tree", default=None, help=TREE_HELP)
    p.add_argument("--chain", default="chain:5")
    p.add_argument("--batch-size", default="1", help="comma list, e.g. 1,2,4: sizes > 1 add a batch throughput table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--first-turn-only", action="store_true", help="only the first turn of multi-turn questions")
    p.add_argument("--quick", action="store_true", help="10 MT-bench first turns, 128 tokens, T=0, vanilla/eagle/hf")
    _add_target_kernels(p)
    p.add_argument("--out", required=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="eaglespec", description="Lossless EAGLE speculative decoding")
    sub = ap.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_chat(sub)
    _add_serve(sub)
    _add_regenerate(sub)
    _add_extract(sub)
    _add_train(sub)
    _add_bench(sub)
    _add_profile(sub)
    _add_export(sub)
    return ap


def _load_engine(a: argparse.Namespace):
    """The target's `Engine` (with the head when --method eagle) and its tokenizer, from generate's,
    chat's or serve's arguments."""
    from .models import Engine, load_target
    from .spec.head import EagleDraftHead

    model, tok = load_target(a.model, device=a.device, quantize=a.quantize, packed=a.packed, compile=a.compile)
    head = None
    if a.method == "eagle":
        head_path = default_head(a.model, a.head)
        if head_path is None:
            raise EaglespecError(f"no draft head shipped for {a.model}; pass --head PATH or --method vanilla")
        head = EagleDraftHead.from_pretrained(head_path, model, draft_vocab=a.draft_vocab)
    return Engine(model, head, tree=a.tree, draft_sampling=a.draft_sampling,
                  sampled_tree=None if a.sampled_tree == "same" else a.sampled_tree), tok


def cmd_generate(a: argparse.Namespace) -> int:
    from .models import eos_ids

    sp = _check_sampling(a)
    if not a.prompt.strip():
        raise EaglespecError("empty prompt")
    eng, tok = _load_engine(a)
    if a.no_chat:
        ids = tok(a.prompt, add_special_tokens=True)["input_ids"]
    else:
        msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [{"role": "user", "content": a.prompt}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    eos = eos_ids(tok, eng.model)
    if a.json:
        out = eng.generate(ids, a.max_new_tokens, sp, a.method, a.seed, eos)
        text = tok.decode(out.token_ids, skip_special_tokens=True)
        print(json.dumps({"text": text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "method": a.method,
                          "tree": (eng.sampled_tree if not sp.greedy and eng.sampled_tree else a.tree)
                          if a.method == "eagle" else None,
                          "prompt_tokens": len(ids), **out.stats.to_dict()}))
        return 0
    _print_stream(eng, tok, ids, a, sp, eos)
    return 0


def _print_stream(eng, tok, ids: list[int], a: argparse.Namespace, sp, eos: list[int], stats=None) -> str:
    """Decode `ids` and print the text to stdout as it becomes final (then a newline); returns the text."""
    from .text import TextStream

    text = TextStream(tok)
    for new, _ in eng.stream(ids, a.max_new_tokens, sp, a.method, a.seed, eos, stats):
        sys.stdout.write(text.push(new))
        sys.stdout.flush()
    sys.stdout.write(text.finish() + "\n")
    sys.stdout.flush()
    return text.text


def _check_sampling(a: argparse.Namespace):
    """generate's and chat's sampling options, checked before any slow loading."""
    from .spec.verify import SamplingParams

    sp = SamplingParams(a.temperature, a.top_p, a.top_k)
    if a.max_new_tokens < 1:
        raise EaglespecError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    return sp


def cmd_chat(a: argparse.Namespace) -> int:
    from .spec import GenerationStats
    from .models import eos_ids

    sp = _check_sampling(a)
    eng, tok = _load_engine(a)
    if tok.chat_template is None:
        raise EaglespecError(f"{a.model} has no chat template: use `eaglespec generate --no-chat`")
    eos, tty = eos_ids(tok, eng.model), sys.stdin.isatty()
    system = [{"role": "system", "content": a.system}] if a.system else []
    history: list[dict] = []
    if tty:
        print("eaglespec chat: a line is a turn; /reset forgets the conversation, /exit or Ctrl-D ends it",
              file=sys.stderr)
    while True:
        if tty:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            history = []
            continue
        if not line.strip():
            continue
        turn = history + [{"role": "user", "content": line.strip()}]
        ids = tok.apply_chat_template(system + turn, add_generation_prompt=True, tokenize=True)
        try:
            eng.check_request(ids, a.max_new_tokens, a.method)
        except EaglespecError as e:  # a conversation grown past the context: say so, keep chatting
            print(f"eaglespec: {e}; /reset to start over", file=sys.stderr)
            continue
        stats = GenerationStats()
        answer = _print_stream(eng, tok, ids, a, sp, eos, stats)
        history = turn + [{"role": "assistant", "content": answer}]
        if a.stats:
            print(f"[{stats.new_tokens} tokens, tau {stats.tau:.2f}, {stats.tokens_per_s:.1f} tok/s]", file=sys.stderr)


def cmd_serve(a: argparse.Namespace) -> int:
    from .models import eos_ids
    from .server import serve

    if not 0 <= a.port <= 65535:
        raise EaglespecError(f"--port must be in 0..65535, got {a.port}")
    for name in ("max_tokens", "max_batch", "max_queue"):
        if getattr(a, name) < 1:
            raise EaglespecError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    eng, tok = _load_engine(a)
    try:
        srv = serve(eng, tok, a.model_id or a.model, eos_ids(tok, eng.model), a.host, a.port, a.method, a.max_tokens,
                    api_key=a.api_key or os.environ.get("EAGLESPEC_API_KEY") or None,
                    batch_tree=None if a.batch_tree == "none" else a.batch_tree, max_batch=a.max_batch,
                    max_queue=a.max_queue)
    except OSError as e:
        raise EaglespecError(f"cannot listen on {a.host}:{a.port} ({e.strerror or e})") from None
    print(f"eaglespec: serving {srv.model_id} ({a.method}, tree {a.tree}) at {srv.url}/v1", file=sys.stderr,
          flush=True)
    try:
        srv.serve_forever()
    finally:
        srv.server_close()
    return 0


def cmd_extract(a: argparse.Namespace) -> int:
    from .train.extract import ExtractConfig, extract

    rep = extract(ExtractConfig(model=a.model, out_dir=a.out, data=a.data, max_len=a.max_len,
                                max_tokens=a.max_tokens, heldout=a.heldout, seed=a.seed, aux_layers=a.aux_layers,
                                aux_only=a.aux_only, dtype=a.dtype))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "shards"} if isinstance(v, dict) else v
                      for k, v in rep.items()}))
    return 0


def cmd_regenerate(a: argparse.Namespace) -> int:
    from .train.regenerate import RegenerateConfig, regenerate

    print(json.dumps(regenerate(_config_from(a, RegenerateConfig))))
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    from .train.trainer import TrainConfig, train

    cfg = _config_from(a, TrainConfig)
    st = train(cfg, resume=not a.no_resume)
    print(json.dumps({"steps": st["step"], "tokens_seen": st["tokens_seen"], "train_time_s": st["train_time_s"],
                      "evals": st["evals"], "head": str(Path(a.out) / "head")}))
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    import torch

    from .models import converted_path, load_target
    from .spec.formats import export_head
    from .spec.head import EagleDraftHead

    model, _ = load_target(a.model, packed=False)
    head = EagleDraftHead.from_pretrained(default_head(a.model, a.head), model, draft_vocab="head")
    dtype = None if a.dtype == "float32" else getattr(torch, a.dtype)  # None: as the head is (fp32)
    if a.format == "gguf":
        from .interop import export_gguf, llama_cpp_eagle3_gap

        target_dir = Path(a.model) if Path(a.model).is_dir() else converted_path(a.model)
        out = export_gguf(head, target_dir, a.out, model.config, dtype)
        gap = llama_cpp_eagle3_gap(model.config.model_type)
        if gap:  # the file is right; this llama.cpp cannot run it (a newer one may)
            print(f"warning: {gap}", file=sys.stderr)
    else:
        out = export_head(head, a.format, a.out, model.config, dtype)
    print(json.dumps({"format": a.format, "arch": head.arch, "out": str(out)}))
    return 0


def cmd_profile(a: argparse.Namespace) -> int:
    from .policy import costmodel
    from .models import Engine
    from .spec.head import EagleDraftHead
    from .models import load_target

    if a.context < 1 or a.repeats < 1:
        raise EaglespecError("--context and --repeats must be >= 1")
    if a.compare:
        return _compare_profiles(a.compare, a.out)
    model, _ = load_target(a.model, device=a.device, quantize=a.quantize, packed=a.packed, compile=a.compile)
    head_path = default_head(a.model, a.head)
    head = EagleDraftHead.from_pretrained(head_path, model, draft_vocab=a.draft_vocab) if head_path else None
    eng = Engine(model, head, tree="auto")
    prof = costmodel.measure(eng, context=a.context, repeats=a.repeats)
    cached = costmodel.profile_path(eng)
    cached.parent.mkdir(parents=True, exist_ok=True)
    prof.save(cached)  # `--tree auto` reads it from here
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        prof.save(out / "cost_curve.json")
        costmodel.plot(prof, out / "cost_curve.png")
    print("| tokens | ms | x one token |\n|---|---|---|")
    for n, t in zip(prof.sizes, prof.verify_s):
        print(f"| {n} | {1000 * t:.1f} | {t / prof.verify_s[0]:.2f} |")
    print(f"draft level: {1000 * prof.draft_level_s:.1f} ms; cached in {cached}")
    return 0


def _compare_profiles(items: list[str], out: str | None) -> int:
    from .policy import costmodel

    if not out:
        raise EaglespecError("--compare needs --out DIR for the PNG")
    profiles = {}
    for item in items:
        label, sep, path = item.partition("=")
        if not sep:
            raise EaglespecError(f"--compare takes LABEL=PATH/cost_curve.json, got {item!r}")
        try:
            profiles[label] = costmodel.CostProfile.load(Path(path))
        except (OSError, ValueError, TypeError) as e:
            raise EaglespecError(f"{path}: not a cost curve ({e})") from None
    Path(out).mkdir(parents=True, exist_ok=True)
    costmodel.plot(profiles, Path(out) / "cost_curve.png")
    sizes = sorted(set().union(*(p.sizes for p in profiles.values())))
    print("| tokens | " + " | ".join(f"{k} (ms)" for k in profiles) + " |")
    print("|---|" + "---|" * len(profiles))
    for n in sizes:
        print(f"| {n} | " + " | ".join(f"{1000 * p.verify_s[p.sizes.index(n)]:.0f}" if n in p.sizes else "" for p in
                                       profiles.values()) + " |")
    print("| one draft level | " + " | ".join(f"{1000 * p.draft_level_s:.1f}" for p in profiles.values()) + " |")
    print(f"plot: {Path(out) / 'cost_curve.png'}")
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from .bench.harness import BenchConfig, parse_methods, run_bench

    try:
        batch_sizes = tuple(int(b) for b in str(a.batch_size).split(","))
    except ValueError:
        raise EaglespecError(f"--batch-size must be a comma list of integers, got {a.batch_size!r}") from None
    if any(b < 1 or b > 64 for b in batch_sizes):
        raise EaglespecError("--batch-size values must be in 1..64")
    if a.quick:  # ~5 minutes here: checks a change, not a result
        a.dataset, a.limit, a.max_new_tokens, a.temperature = "mt_bench", 10, 128, "0"
        a.first_turn_only, a.methods = True, "vanilla,eagle,hf"
    methods = parse_methods(a.methods)
    try:
        temps = tuple(float(t) for t in a.temperature.split(","))
    except ValueError:
        raise EaglespecError(f"--temperature must be a comma list of numbers, got {a.temperature!r}") from None
    head = default_head(a.model, a.head)
    if head is None and any(m.startswith("eagle") for m in methods):
        raise EaglespecError(f"no draft head for {a.model}: pass --head or drop the eagle methods")
    if a.max_new_tokens < 1:
        raise EaglespecError("--max-new-tokens must be >= 1")
    if a.limit is not None and a.limit < 1:
        raise EaglespecError("--limit must be >= 1")
    cfg = BenchConfig(model=a.model, head=head, draft_vocab=a.draft_vocab, datasets=tuple(a.dataset.split(",")),
                      limit=a.limit, spread=a.spread, temperatures=temps, max_new_tokens=a.max_new_tokens, methods=methods, tree=a.tree,
                      chain=a.chain, seed=a.seed, out=a.out, first_turn_only=a.first_turn_only,
                      batch_sizes=batch_sizes, quantize=a.quantize, packed=a.packed, compile=a.compile)
    result = run_bench(cfg)
    print(open(Path(a.out) / "report.md").read())
    # our methods must equal vanilla; a peer that does not (transformers' PLD in fp32 near-ties) is reported only
    bad_eq = [r for r in result["summary"] + result["batch_summary"]
              if r["greedy_equal"] is False and r.get("method", "eagle").startswith("eagle")]
    if bad_eq:
        print("eaglespec: error: greedy output differs from vanilla for "
              + ", ".join(f"{r.get('method', 'eagle at batch size %s' % r.get('batch_size'))} on {r['dataset']}"
                            for r in bad_eq), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    problem = unsupported_transformers()
    if problem:
        print(f"eaglespec: error: {problem}", file=sys.stderr)
        return 2
    if hasattr(args, "tree") and args.tree is None:
        args.tree = default_tree(getattr(args, "device", "cpu"))  # bench runs on the CPU
    try:
        if getattr(args, "quantize", None) == "fastest":
            from .cpu.quant import fastest_quantizer

            args.quantize = fastest_quantizer()
        if getattr(args, "device", None) is not None:
            check_device(args.device)
        if getattr(args, "seed", None) is not None:
            from .spec.verify import SEEDS

            if args.seed not in SEEDS:
                raise EaglespecError(f"--seed must be in {SEEDS.start}..{SEEDS.stop - 1}, got {args.seed}")
        return {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "regenerate": cmd_regenerate,
                "extract": cmd_extract, "train": cmd_train, "bench": cmd_bench, "profile": cmd_profile,
                "export": cmd_export}[args.command](args)
    except (EaglespecError, ValueError) as e:  # bad input: its one line
        print(f"eaglespec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("eaglespec: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 (a bug of ours: one line, not a traceback; EAGLESPEC_DEBUG=1 shows it)
        if os.environ.get("EAGLESPEC_DEBUG"):
            raise
        first = str(e).splitlines()[0] if str(e) else ""
        print(f"eaglespec: internal error: {type(e).__name__}: {first} (EAGLESPEC_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
