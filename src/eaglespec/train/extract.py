"""Feature extraction: one frozen target forward per conversation -> shards of (ids, features, mask).

Layout of ``out_dir``::

    manifest.json                  what was extracted (model, max_len, seed, split sizes)
    train/shard_00000.safetensors  input_ids int32 (N,), features fp16 (N, H), loss_mask uint8 (N,),
                                   offsets int64 (n+1,), token_counts int64 (V,) over assistant tokens
    heldout/shard_00000.safetensors

Shard i of a split always holds conversations [i*K, (i+1)*K) of that split's fixed order, and each
shard is written atomically, so an interrupted run resumes at the first missing shard.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from ..errors import CheckpointError, EaglespecError
from ..io import atomic_save_safetensors, atomic_write_json
from ..models import HiddenStateTap, check_layers
from ..spec.formats import default_aux_layers
from .data import load_conversations, render, split

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHARD_KEYS = ("input_ids", "features", "loss_mask", "offsets", "token_counts")
AUX_WORDS = ("", "auto", "none")


@dataclass
class ExtractConfig:
    model: str
    out_dir: str
    data: str = "sharegpt"
    max_len: int = 1024
    max_tokens: int = 1_000_000  # budget for the train split
    heldout: int = 100
    seed: int = 0
    conversations_per_shard: int = 64
    batch_tokens: int = 4096
    aux_layers: str = "auto"  # also write each shard's aux file: these layers' hidden states (EAGLE-3 fusion;
    # auto = EAGLE-3's low, mid and high layers 2, L // 2, L - 3 of a target deep enough; none = no aux file)
    aux_only: bool = False  # only add aux files to the shards already in out_dir (e.g. `regenerate`'s)
    dtype: str = "float32"  # or "bfloat16": ~4x faster on a CPU with bf16 matrix units, features within ~2 %


@torch.inference_mode()
def features_for(model, batch: list[list[int]], layers: list[int] | None = None) -> list[torch.Tensor]:
    """Final-norm hidden states (what the LM head reads) for a right-padded batch, (n, H) each;
    with `layers`, those layers' hidden states after them (`output_hidden_states` numbering), from
    the same forward, (n, 1 + k, H)."""
    width = max(len(x) for x in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    att = torch.zeros(len(batch), width, dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        att[i, : len(x)] = 1
    dev = next(model.parameters()).device
    decoder = model.get_decoder()
    tap = HiddenStateTap.of(decoder, layers or [])
    with tap.capture(layers or []):
        out = decoder(input_ids=ids.to(dev), attention_mask=att.to(dev), **tap.forward_kwargs(layers or []))
    h = torch.stack([out.last_hidden_state, *tap.read(out, layers)], 2) if layers else out.last_hidden_state
    return [h[i, : len(x)].float().cpu() for i, x in enumerate(batch)]


def _all_features(model, seqs: list[list[int]], batch_tokens: int, bar: tqdm,
                  layers: list[int] | None = None) -> list[torch.Tensor]:
    """`features_for` every sequence, batched by length (at most `batch_tokens` padded per batch)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    feats: list[torch.Tensor] = [None] * len(seqs)  # type: ignore[list-item]
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end - start + 1) * len(seqs[order[end]]) <= batch_tokens:
            end += 1
        idx = order[start:end]
        for i, f in zip(idx, features_for(model, [seqs[i] for i in idx], layers)):
            feats[i] = f
            bar.update(len(seqs[i]))
        start = end
    return feats


def save_aux(shard: Path, aux: torch.Tensor, layers: list[int]) -> None:
    """Write a shard's aux file: (n, k, H) hidden states of `layers`, stored fp16."""
    atomic_save_safetensors({"aux": _fp16(aux, "aux features"), "layers": torch.tensor(layers, dtype=torch.int64)},
                            aux_path(shard))


def add_aux(folder: Path, model, layers: list[int], batch_tokens: int = 4096) -> int:
    """Write the aux file of every shard under `folder` (all splits) that has none; resumable shard
    by shard. Returns the tokens done now."""
    if not layers:
        raise EaglespecError("no aux layers given")
    check_layers(layers, model)
    shards = []
    for s in shard_files(folder, "*/shard_*.safetensors") + shard_files(folder):
        if not aux_path(s).exists():
            shards.append(s)
            continue
        with safe_open(str(aux_path(s)), "pt") as f:  # only the small tensor, not the states
            has = f.get_tensor("layers").tolist() if "layers" in f.keys() else None
        if has != list(layers):
            raise CheckpointError(f"{aux_path(s)}: holds layers {has}, asked for {list(layers)}; "
                                  "delete the aux files to recompute them")
    sizes = []
    for s in shards:  # for the progress bar: the token count alone, not the whole shard (read below)
        with safe_open(str(s), "pt") as f:
            sizes.append(f.get_slice("input_ids").get_shape()[0])
    bar = tqdm(total=sum(sizes), unit="tok", unit_scale=True, desc=f"aux layers {layers}", dynamic_ncols=True)
    for path in shards:
        t = read_shard(path)
        off = t["offsets"].tolist()
        seqs = [t["input_ids"][a:b].tolist() for a, b in zip(off, off[1:])]
        save_aux(path, torch.cat(_all_features(model, seqs, batch_tokens, bar, layers))[:, 1:], layers)
    bar.close()
    return sum(sizes)


def _shard(model, items: list[tuple[list[int], list[int]]], vocab: int, batch_tokens: int, bar: tqdm,
           layers: list[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """One shard's tensors and, with `layers`, its aux states (n, k, H), from one forward per batch."""
    feats = _all_features(model, [ids for ids, _ in items], batch_tokens, bar, layers)
    finals = [f[:, 0] for f in feats] if layers else feats
    shard = pack_shard([(ids, mask, f) for (ids, mask), f in zip(items, finals)], vocab)  # type: ignore[misc]
    return shard, torch.cat([f[:, 1:] for f in feats]) if layers else None


def _fp16(x: torch.Tensor, what: str) -> torch.Tensor:
    """Hidden states as stored (fp16), refusing values fp16 cannot hold."""
    if x.abs().max() > 60000:
        raise EaglespecError(f"{what} overflow float16; this target needs bf16 feature storage")
    return x.half()


def pack_shard(items: list[tuple[list[int], list[int], torch.Tensor]], vocab: int) -> dict[str, torch.Tensor]:
    """(input ids, loss mask, features) per conversation -> one shard's tensors."""
    ids = torch.tensor([t for x, _, _ in items for t in x], dtype=torch.int32)
    mask = torch.tensor([m for _, ms, _ in items for m in ms], dtype=torch.uint8)
    f = _fp16(torch.cat([f for _, _, f in items]), "features")
    lengths = torch.tensor([0] + [len(x) for x, _, _ in items], dtype=torch.int64)
    counts = torch.bincount(ids[mask.bool()].long(), minlength=vocab)
    return {"input_ids": ids, "features": f, "loss_mask": mask, "offsets": lengths.cumsum(0),
            "token_counts": counts}


def unpack_shard(t: dict[str, torch.Tensor]) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """The inverse of `pack_shard`: one (ids, mask, features) item per conversation."""
    off = t["offsets"].tolist()
    return [(t["input_ids"][a:b].tolist(), t["loss_mask"][a:b].tolist(), t["features"][a:b])
            for a, b in zip(off, off[1:])]


def extract(cfg: ExtractConfig) -> dict:
    from ..models import load_target

    if cfg.dtype not in DTYPES:
        raise EaglespecError(f"--dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    parse_layers(cfg.aux_layers)  # a bad list fails before the model loads
    out = Path(cfg.out_dir)
    if cfg.aux_only:
        if not shard_files(out, "*/shard_*.safetensors"):
            raise EaglespecError(f"{out}: no feature shards to add aux layers to")
        model, _ = load_target(cfg.model, dtype=DTYPES[cfg.dtype])
        layers = aux_layers_for(cfg.aux_layers, model.config.num_hidden_layers)
        if not layers:
            raise EaglespecError("--aux-only needs --aux-layers (this target is too shallow for auto)")
        t0 = time.perf_counter()
        n = add_aux(out, model, layers, cfg.batch_tokens)
        return {"aux_layers": layers, "new_tokens": n, "tokens_per_s": n / max(time.perf_counter() - t0, 1e-9)}
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    settings = {"model": cfg.model, "data": cfg.data, "max_len": cfg.max_len, "heldout": cfg.heldout,
                "seed": cfg.seed, "conversations_per_shard": cfg.conversations_per_shard}
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text())
        if old.get("settings") != settings:
            raise EaglespecError(f"{out} holds an extraction with other settings {old.get('settings')}; "
                                 "use another --out or the same settings to resume")
    model, tok = load_target(cfg.model, dtype=DTYPES[cfg.dtype])
    layers = aux_layers_for(cfg.aux_layers, model.config.num_hidden_layers)
    vocab = model.config.vocab_size
    train_convs, held_convs = split(load_conversations(cfg.data), cfg.seed, cfg.heldout)
    report = {"settings": settings, "hidden_size": model.config.hidden_size, "vocab_size": vocab}
    for name, convs, budget in (("heldout", held_convs, None), ("train", train_convs, cfg.max_tokens)):
        folder = out / name
        folder.mkdir(exist_ok=True)
        k = cfg.conversations_per_shard
        n_shards = (len(convs) + k - 1) // k
        done_tokens, shards, t_new, tok_new = 0, [], 0.0, 0
        bar = tqdm(total=budget, unit="tok", unit_scale=True, desc=f"extract {name}", dynamic_ncols=True)
        for s in range(n_shards):
            if budget is not None and done_tokens >= budget:
                break
            path = folder / f"shard_{s:05d}.safetensors"
            if path.exists():  # resumed: this shard was finished before
                n = int(read_shard(path)["offsets"][-1])
                bar.update(n)
            else:
                items = [render(c, tok, cfg.max_len) for c in convs[s * k:(s + 1) * k]]
                items = [(i, m) for i, m in items if sum(m) > 0 and len(i) > 1]
                t0 = time.perf_counter()
                tensors, aux = _shard(model, items, vocab, cfg.batch_tokens, bar, layers)
                t_new += time.perf_counter() - t0
                n = int(tensors["offsets"][-1])
                tok_new += n
                atomic_save_safetensors(tensors, path)
                if aux is not None:  # a run stopped between the two files gets this one from add_aux below
                    save_aux(path, aux, layers)
                bar.set_postfix(tok_per_s=f"{tok_new / max(t_new, 1e-9):.0f}")
            done_tokens += n
            shards.append({"file": f"{name}/{path.name}", "tokens": n})
            # after every shard, so that an interrupted run's manifest still describes what is on disk
            report[name] = {"shards": shards, "tokens": done_tokens,
                            "new_tokens": tok_new, "tokens_per_s": tok_new / t_new if t_new else None}
            atomic_write_json(report, manifest_path)
        bar.close()
    if layers:  # aux files of shards written without them (a resumed run's, or one stopped mid-write)
        report["aux_layers"] = layers
        add_aux(out, model, layers, cfg.batch_tokens)
    return report


def shard_files(folder: Path, pattern: str = "shard_*.safetensors") -> list[Path]:
    """The feature shards in `folder`, in order (not their aux files)."""
    return sorted(p for p in folder.glob(pattern) if not p.name.endswith(".aux.safetensors"))


def parse_layers(text: str) -> list[int]:
    """ "3,15,27" -> [3, 15, 27] ("" and "none" -> []; "auto" -> [] here: see `aux_layers_for`)."""
    if text.strip() in AUX_WORDS:
        return []
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise EaglespecError(f"aux layers must be comma-separated integers, auto or none, got {text!r}") from None


def aux_layers_for(text: str, num_layers: int) -> list[int]:
    """The aux layers `text` names for a target of `num_layers` layers: "auto" = EAGLE-3's low, mid
    and high layers (`default_aux_layers`) where the target has them, else none."""
    if text.strip() != "auto":
        return parse_layers(text)
    return default_aux_layers(num_layers) or []


def aux_path(shard: Path) -> Path:
    """Where a shard's aux features lie: the hidden states of more target layers, for a head that
    fuses them (`head.aux_layers`), kept beside the shard so one extraction serves both kinds."""
    return shard.with_name(shard.stem + ".aux.safetensors")


def _open(path: Path, what: str):
    """A safetensors file opened memory-mapped; a corrupt or foreign one is an error naming it."""
    try:
        return safe_open(str(path), "pt")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: corrupt or truncated {what} ({e}); delete it and re-run extract") from None


def _check_shard(path: Path, keys, shape: Callable[[str], list[int]], n: int) -> None:
    missing = [k for k in SHARD_KEYS if k not in keys]
    if missing:
        raise CheckpointError(f"{path}: not a feature shard (missing {missing})")
    if any(shape(k)[0] != n for k in ("input_ids", "features", "loss_mask")) or len(shape("features")) != 2:
        raise CheckpointError(f"{path}: inconsistent shard (offsets say {n} tokens)")


def _check_aux(path: Path, keys, read: Callable[[str], torch.Tensor], shape: Callable[[str], list[int]],
               layers: list[int], n: int) -> None:
    if "aux" not in keys or "layers" not in keys:
        raise CheckpointError(f"{path}: not an aux shard (needs 'aux' and 'layers')")
    if read("layers").tolist() != list(layers):
        raise CheckpointError(f"{path}: holds layers {read('layers').tolist()}, the head fuses {list(layers)}")
    if len(shape("aux")) != 3 or shape("aux")[:2] != [n, len(layers)]:
        raise CheckpointError(f"{path}: aux shape {tuple(shape('aux'))} does not match its shard ({n} tokens)")


def _open_aux(shard: Path, layers: list[int]):
    path = aux_path(shard)
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; run `eaglespec extract --aux-layers "
                              f"{','.join(map(str, layers))}` on this feature folder")
    return path, _open(path, "aux shard")


def read_aux(shard: Path, layers: list[int], n: int) -> torch.Tensor:
    """(n, k, H) aux features of `shard` for exactly these layers; a clear error otherwise."""
    path, f = _open_aux(shard, layers)
    t = {k: f.get_tensor(k) for k in f.keys()}
    _check_aux(path, t.keys(), t.__getitem__, lambda k: list(t[k].shape), layers, n)
    return t["aux"]


def read_shard(path: Path) -> dict[str, torch.Tensor]:
    """Load and check one shard; a truncated or foreign file gives an error naming it."""
    f = _open(path, "feature shard")
    t = {k: f.get_tensor(k) for k in f.keys()}
    n = int(t["offsets"][-1]) if "offsets" in t else -1
    _check_shard(path, t.keys(), lambda k: list(t[k].shape), n)
    return t


class ShardReader:
    """One shard checked as `read_shard` / `read_aux` check it, its features (with `aux_layers`, those
    layers' hidden states after them) read a row range at a time from the memory-mapped files: a
    training set may be larger than memory, and processes reading the same shards share their pages."""

    def __init__(self, path: Path, aux_layers: list[int] | None = None):
        f = _open(path, "feature shard")
        keys = set(f.keys())
        small = {k: f.get_tensor(k) for k in ("input_ids", "loss_mask", "offsets", "token_counts") if k in keys}
        n = int(small["offsets"][-1]) if "offsets" in small else -1
        _check_shard(path, keys, lambda k: f.get_slice(k).get_shape(), n)
        self.input_ids, self.loss_mask = small["input_ids"], small["loss_mask"]
        self.offsets, self.token_counts = small["offsets"].tolist(), small["token_counts"]
        self._features, self._aux = f.get_slice("features"), None
        self.width = self._features.get_shape()[1]
        if aux_layers:
            apath, a = _open_aux(path, aux_layers)
            _check_aux(apath, set(a.keys()), a.get_tensor, lambda k: a.get_slice(k).get_shape(), aux_layers, n)
            self._aux = a.get_slice("aux")
            self.width *= 1 + len(aux_layers)

    def rows(self, a: int, b: int) -> torch.Tensor:
        """Features of tokens [a, b): (b - a, width), fp16."""
        feats = self._features[a:b]
        if self._aux is None:
            return feats
        return torch.cat([feats[:, None], self._aux[a:b].to(feats.dtype)], 1).flatten(1)
