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

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tqdm import tqdm

from ..errors import CheckpointError, EaglespecError
from ..io import atomic_save_safetensors, atomic_write_json
from .data import load_conversations, render, split

SHARD_KEYS = ("input_ids", "features", "loss_mask", "offsets", "token_counts")


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


@torch.inference_mode()
def features_for(model, batch: list[list[int]]) -> list[torch.Tensor]:
    """Final-norm hidden states (what the LM head reads) for a right-padded batch."""
    width = max(len(x) for x in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    att = torch.zeros(len(batch), width, dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        att[i, : len(x)] = 1
    dev = next(model.parameters()).device
    h = model.get_decoder()(input_ids=ids.to(dev), attention_mask=att.to(dev)).last_hidden_state
    return [h[i, : len(x)].float().cpu() for i, x in enumerate(batch)]


def _shard(model, items: list[tuple[list[int], list[int]]], vocab: int, batch_tokens: int,
           bar: tqdm) -> dict[str, torch.Tensor]:
    order = sorted(range(len(items)), key=lambda i: len(items[i][0]))
    feats: list[torch.Tensor | None] = [None] * len(items)
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end - start + 1) * len(items[order[end]][0]) <= batch_tokens:
            end += 1
        idx = order[start:end]
        for i, f in zip(idx, features_for(model, [items[i][0] for i in idx])):
            feats[i] = f
            bar.update(len(items[i][0]))
        start = end
    return pack_shard([(ids, mask, f) for (ids, mask), f in zip(items, feats)], vocab)  # type: ignore[misc]


def pack_shard(items: list[tuple[list[int], list[int], torch.Tensor]], vocab: int) -> dict[str, torch.Tensor]:
    """(input ids, loss mask, features) per conversation -> one shard's tensors."""
    ids = torch.tensor([t for x, _, _ in items for t in x], dtype=torch.int32)
    mask = torch.tensor([m for _, ms, _ in items for m in ms], dtype=torch.uint8)
    f = torch.cat([f for _, _, f in items])
    if f.abs().max() > 60000:
        raise EaglespecError("features overflow float16; this target needs bf16 feature storage")
    lengths = torch.tensor([0] + [len(x) for x, _, _ in items], dtype=torch.int64)
    counts = torch.bincount(ids[mask.bool()].long(), minlength=vocab)
    return {"input_ids": ids, "features": f.half(), "loss_mask": mask, "offsets": lengths.cumsum(0),
            "token_counts": counts}


def unpack_shard(t: dict[str, torch.Tensor]) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """The inverse of `pack_shard`: one (ids, mask, features) item per conversation."""
    off = t["offsets"].tolist()
    return [(t["input_ids"][a:b].tolist(), t["loss_mask"][a:b].tolist(), t["features"][a:b])
            for a, b in zip(off, off[1:])]


def extract(cfg: ExtractConfig) -> dict:
    from ..models import load_target

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    settings = {"model": cfg.model, "data": cfg.data, "max_len": cfg.max_len, "heldout": cfg.heldout,
                "seed": cfg.seed, "conversations_per_shard": cfg.conversations_per_shard}
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text())
        if old.get("settings") != settings:
            raise EaglespecError(f"{out} holds an extraction with other settings {old.get('settings')}; "
                                 "use another --out or the same settings to resume")
    model, tok = load_target(cfg.model)
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
                tensors = _shard(model, items, vocab, cfg.batch_tokens, bar)
                t_new += time.perf_counter() - t0
                n = int(tensors["offsets"][-1])
                tok_new += n
                atomic_save_safetensors(tensors, path)
                bar.set_postfix(tok_per_s=f"{tok_new / max(t_new, 1e-9):.0f}")
            done_tokens += n
            shards.append({"file": f"{name}/{path.name}", "tokens": n})
            # after every shard, so that an interrupted run's manifest still describes what is on disk
            report[name] = {"shards": shards, "tokens": done_tokens,
                            "new_tokens": tok_new, "tokens_per_s": tok_new / t_new if t_new else None}
            atomic_write_json(report, manifest_path)
        bar.close()
    return report


def read_shard(path: Path) -> dict[str, torch.Tensor]:
    """Load and check one shard; a truncated or foreign file gives an error naming it."""
    try:
        t = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: corrupt or truncated feature shard ({e}); delete it and re-run extract") from None
    missing = [k for k in SHARD_KEYS if k not in t]
    if missing:
        raise CheckpointError(f"{path}: not a feature shard (missing {missing})")
    n = int(t["offsets"][-1])
    if t["input_ids"].shape[0] != n or t["features"].shape[0] != n or t["loss_mask"].shape[0] != n:
        raise CheckpointError(f"{path}: inconsistent shard (offsets say {n} tokens)")
    return t
