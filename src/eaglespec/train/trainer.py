"""Training the draft head from extracted features (paper section "Training the Draft Model").

Input at position j: f_j (+ uniform noise while training) and the shifted token t_{j+1}.
Target: f_{j+1}.  loss = SmoothL1(f_hat_{j+1}, f_{j+1}) + w * CE(p_{j+2}, p_hat_{j+2}), where
p_{j+2} = softmax(LM_head(f_{j+1})) is the target's own distribution (a soft label).
Only positions inside assistant turns carry loss.

An ``eagle3`` head (``--arch eagle3``) predicts no feature: its loss is the CE term alone (weight 1),
over unrolled steps (training-time test, ``--unroll``, 3 by default for it).

One process by default; `accelerate launch --multi_gpu --num_processes N -m eaglespec.cli train ...` or
`torchrun --nproc_per_node N -m eaglespec.cli train ...` runs N (DDP over gloo on a CPU-only machine),
each taking the same number of batches. accelerate's `--cpu` flag starts one process whatever N.
"""

from __future__ import annotations

import copy
import json
import math
import random
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import Iterator

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import DynamicCache

from ..spec.cache import KVCache
from ..errors import CheckpointError, EaglespecError
from ..spec.formats import eagle3_default_aux_layers, llama_layer_config
from ..spec.head import ARCHS, INPUT_MODES, EagleDraftHead, read_head_config, read_training_record
from ..io import atomic_torch_save, atomic_write_json, atomic_write_text, short_path
from ..models import eos_ids
from ..spec.tree import float_mask
from .extract import DTYPES, ShardReader, parse_layers, shard_files


@dataclass
class TrainConfig:
    features: str  # an `eaglespec extract` output folder, or several joined by commas (held-out: the first's)
    out: str  # run folder: checkpoints, log, curves, final head
    model: str = "smollm2-135m-instruct"
    epochs: int = 2  # passes over the training split
    lr: float = 5e-4  # AdamW peak learning rate (linear warm-up, then cosine down to lr * min_lr_ratio)
    min_lr_ratio: float = 0.1  # the final learning rate as a share of --lr
    warmup_steps: int = 50  # optimizer steps of linear warm-up
    batch_tokens: int = 4096  # padded tokens per optimizer step (whole conversations packed up to it)
    noise: float = 0.1  # U(-noise, noise) on input features
    ce_weight: float = 0.1  # weight of the token loss (cross-entropy against the target's next-token law)
    reg_weight: float = 1.0  # SmoothL1 feature regression (0 = CE only, as EAGLE-3 trains; the paper uses 1)
    grad_clip: float = 0.5  # gradient norm clip
    weight_decay: float = 0.0  # AdamW weight decay
    draft_vocab: int = -1  # tokens the head may propose: 0 = all; -1 = the --init head's own, else 8192
    eval_conversations: int = 16  # held-out conversations scored at each checkpoint (the acceptance curve)
    eval_steps: int = 5  # draft depths scored on them (step-n accuracy of the head fed its own outputs)
    save_every: int = 50  # optimizer steps between checkpoints (a rerun resumes from the last)
    max_steps: int = 0  # 0 = no limit (stop after `epochs`)
    seed: int = 0  # data order, noise and initialisation
    device: str = "cpu"  # cpu or cuda
    input_mode: str = field(default="feature+shifted_token", metadata={
        "choices": INPUT_MODES, "help": "what the head reads beside f_j (paper Fig. 8): feature+shifted_token = "
        "EAGLE (f_j and t_{j+1}); feature+unshifted_token = f_j and t_j; feature = f_j alone; token = t_{j+1} "
        "alone (a token-level draft)"})
    init: str = ""  # a head folder to start from (weights and draft vocabulary), e.g. to train a shipped head further
    arch: str = field(default="eagle3", metadata={
        "choices": ARCHS, "help": "eagle3 = EAGLE-3's head (three fused target layers, own LM head, token loss "
        "only; it drafts better than the hybrid on the same data and budget: REPRODUCTION.md); eagle1 = official "
        "EAGLE's head; hybrid = eagle1's with a layer-0 input norm and optional --aux-layers (the architecture of "
        "older heads, such as SmolLM2's default one: train them further with --init)"})
    unroll: int = 0  # training-time test: steps of the head fed its own predictions (0: 1 = the paper; eagle3 3)
    unroll_decay: float = 0.8  # loss weight of step s is unroll_decay ** (s - 1)
    unroll_fraction: float = 0.25  # share of anchors whose chains train at steps >= 2
    layers: int = 0  # decoder layers of the head (0: the --init head's, else 1); more than --init's grows it
    aux_layers: str = ""  # EAGLE-3 feature fusion: target layers fed to the head too, e.g. "3,15,27" ("": --init's;
    # eagle3: 2, L // 2, L - 3)
    revocab: bool = False  # with init: rebuild its draft vocabulary (its size, or --draft-vocab's) from this run's data
    intermediate_size: int = 0  # a new head's MLP width (0: the target's); narrower = smaller and faster to draft
    dtype: str = field(default="float32", metadata={
        "choices": tuple(DTYPES), "help": "bfloat16: the step's matrix products in bf16 autocast, weights "
        "and optimizer state in fp32 (about 1.7x faster on a CPU with AVX512-BF16)"})

    def validate(self) -> None:
        if self.unroll < 0:
            raise EaglespecError(f"unroll must be >= 0 (0: the architecture's own), got {self.unroll}")
        if self.unroll == 0:  # the architecture's own
            self.unroll = 3 if self.arch == "eagle3" else 1
        checks = [("epochs", self.epochs >= 1, ">= 1"), ("lr", self.lr > 0, "> 0"),
                  ("batch_tokens", self.batch_tokens >= 1, ">= 1"), ("noise", self.noise >= 0, ">= 0"),
                  ("ce_weight", self.ce_weight >= 0, ">= 0"), ("reg_weight", self.reg_weight >= 0, ">= 0"),
                  ("unroll", self.unroll >= 1, ">= 1"), ("unroll_decay", self.unroll_decay > 0, "> 0"),
                  ("unroll_fraction", 0 < self.unroll_fraction <= 1, "in (0, 1]"), ("layers", self.layers >= 0, ">= 0"),
                  ("intermediate_size", self.intermediate_size >= 0, ">= 0 (0: the target's)"),
                  ("dtype", self.dtype in DTYPES, "one of " + ", ".join(DTYPES)),
                  ("draft_vocab", self.draft_vocab >= -1, ">= -1 (-1: the --init head's, 0: all tokens)")]
        checks.append(("input_mode", self.input_mode in INPUT_MODES, "one of " + ", ".join(INPUT_MODES)))
        checks.append(("arch", self.arch in ARCHS, "one of " + ", ".join(ARCHS)))
        if self.arch != "hybrid":
            checks.append(("input_mode", self.input_mode == INPUT_MODES[0], f"{INPUT_MODES[0]} for arch {self.arch}"))
            checks.append(("layers", self.layers <= 1, f"0 or 1 for arch {self.arch}"))
        if self.arch == "eagle1":
            checks.append(("aux_layers", not self.aux_layers, "empty for an eagle1 head"))
        for name, ok, want in checks:
            if not ok:
                raise EaglespecError(f"{name} must be {want}, got {getattr(self, name)}")
        if self.arch == "eagle3" and self.ce_weight == 0:
            raise EaglespecError("an eagle3 head trains on the token loss alone: ce_weight must be > 0")
        if self.ce_weight + self.reg_weight == 0:
            raise EaglespecError("ce_weight and reg_weight are both 0: there is nothing to train on")
        if self.intermediate_size and self.init:
            raise EaglespecError("intermediate_size shapes a new head; an --init head keeps its own MLP width")
        if self.revocab and not self.init:
            raise EaglespecError("revocab rebuilds the --init head's draft vocabulary: give --init "
                                 "(without it --draft-vocab picks one from the data)")


# -- data ---------------------------------------------------------------------------------------------
class FeatureRows(Sequence):
    """Each conversation's features, read from its shard when indexed (`ShardReader.rows`)."""

    def __init__(self) -> None:
        self.spans: list[tuple[ShardReader, int, int]] = []

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, i: int) -> torch.Tensor:
        reader, a, b = self.spans[i]
        return reader.rows(a, b)


@dataclass
class Sequences:
    """A split's conversations: token ids and loss masks in memory, features as `FeatureRows` (or
    any sequence of (n, width) tensors)."""
    ids: list[torch.Tensor] = field(default_factory=list)
    feats: Sequence[torch.Tensor] = field(default_factory=list)
    mask: list[torch.Tensor] = field(default_factory=list)
    token_counts: torch.Tensor | None = None
    width: int = 0


def load_split(*folders: Path, aux_layers: list[int] | None = None) -> Sequences:
    """Every shard of the given split folders, in order. With `aux_layers`, each conversation's
    features are f_j followed by those layers' hidden states (the shards' aux files), (N, H * (1 + k)).
    Features stay on disk until a batch reads them."""
    shards = []
    for folder in folders:
        found = shard_files(folder)
        if not found:
            raise EaglespecError(f"{folder}: no feature shards (run `eaglespec extract` first)")
        shards += found
    seqs, rows, widths = Sequences(), FeatureRows(), set()
    for path in shards:
        r = ShardReader(path, aux_layers)
        widths.add(r.width)
        for a, b in zip(r.offsets, r.offsets[1:]):
            seqs.ids.append(r.input_ids[a:b].long())
            rows.spans.append((r, a, b))
            seqs.mask.append(r.loss_mask[a:b].bool())
        c = r.token_counts
        seqs.token_counts = c.clone() if seqs.token_counts is None else seqs.token_counts + c
    if len(widths) > 1:
        raise EaglespecError(f"feature shards of {', '.join(map(str, folders))} differ in width: {sorted(widths)}")
    seqs.feats, seqs.width = rows, widths.pop()
    return seqs


def epoch_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Deterministic batches of conversation indices: shuffle, sort within windows, pack by padded size."""
    order = list(range(len(lengths)))
    random.Random(seed * 1000 + epoch).shuffle(order)
    batches: list[list[int]] = []
    for w in range(0, len(order), 64):
        window = sorted(order[w:w + 64], key=lambda i: lengths[i])
        cur: list[int] = []
        for i in window:
            if cur and (len(cur) + 1) * max(lengths[j] for j in cur + [i]) > batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    random.Random(seed * 1000 + epoch + 1).shuffle(batches)
    return batches


def collate(seqs: Sequences, idx: list[int], device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = [seqs.feats[i] for i in idx]  # each read from disk once
    T = max(seqs.ids[i].numel() for i in idx)
    ids = torch.zeros(len(idx), T, dtype=torch.long)
    feats = torch.zeros(len(idx), T, rows[0].shape[-1])
    mask = torch.zeros(len(idx), T, dtype=torch.bool)
    for r, (i, f) in enumerate(zip(idx, rows)):
        n = seqs.ids[i].numel()
        ids[r, :n], feats[r, :n], mask[r, :n] = seqs.ids[i], f.float(), seqs.mask[i]
    return ids.to(device), feats.to(device), mask.to(device)


def draft_vocabulary(counts: torch.Tensor, size: int, always: list[int],
                     fill: list[int] | None = None) -> torch.Tensor | None:
    """The `size` most frequent assistant tokens (plus `always`, e.g. EOS), sorted by id.

    With `fill` (an older draft vocabulary, e.g. the --init head's): only tokens the data contains
    are taken by frequency, and the rest of the room goes to `fill`'s lowest ids (BPE merge order,
    roughly frequency), so a small data set refreshes a vocabulary without emptying it."""
    if size <= 0 or size >= counts.numel():
        return None
    top = torch.topk(counts.double() + 1e-3 * torch.rand(counts.numel(), generator=torch.Generator().manual_seed(0)),
                     size).indices.tolist()
    if fill is not None:
        top = [t for t in top if counts[t] > 0] + sorted(fill) + [t for t in top if counts[t] == 0]
    chosen = set(top[: size - len(always)]) | set(always)
    for t in top:
        if len(chosen) >= size:
            break
        chosen.add(t)
    return torch.tensor(sorted(chosen)[:size], dtype=torch.long)


# -- the loss -------------------------------------------------------------------------------------------
def eagle_loss(head: EagleDraftHead, ids: torch.Tensor, feats: torch.Tensor, mask: torch.Tensor, noise: float,
               ce_weight: float, generator: torch.Generator | None = None, unroll: int = 1,
               unroll_decay: float = 1.0, unroll_fraction: float = 1.0,
               reg_weight: float = 1.0) -> tuple[torch.Tensor, dict]:
    """ids, feats, mask: (B, T[, H]). The shift: input (f_j, t_{j+1}) -> prediction of f_{j+1} (the
    head's `input_mode` may read t_j instead, or zero one input).
    Loss per step: `reg_weight` * SmoothL1(f_hat, f) + `ce_weight` * CE(target's distribution, draft's);
    CE alone for a head that predicts no feature (eagle3).

    With `unroll` = k > 1 (training-time test, as in HASS / EAGLE-3): step s = 2..k feeds the head its
    own step s-1 predictions, exactly as drafting does (anchor j sees the real prefix up to j and its
    own chain), and adds that step's loss weighted `unroll_decay`^(s-1). Step 1 alone is the paper's
    loss; the later steps train the head on the feature errors it will meet at inference. Chains are
    independent, so steps >= 2 run on a random `unroll_fraction` of the anchors (`unroll_anchors`):
    the LM head at every step is most of the cost.
    """
    inp_f = feats[:, :-1]  # f_j, and the aux layers' hidden states after it if the head fuses them
    feats = feats[..., : getattr(head, "module", head).hidden_size]  # what the head predicts: f_{j+1}
    if noise > 0:
        u = torch.rand(inp_f.shape, generator=generator, device="cpu").to(inp_f.device)
        inp_f = inp_f + (u * 2 - 1) * noise
    B, T = inp_f.shape[:2]
    keep = mask[:, 1:].bool()  # f_{j+1} sits on an assistant token
    core = getattr(head, "module", head)  # unwrapped (DDP) for the frozen LM head
    # LM-head products only where the loss is (assistant tokens): they dominate a step on CPU, and
    # prompts and padding are a quarter or more of the positions. Soft labels once, for every step.
    with torch.no_grad():
        p_target = core.target_logits(feats[:, 1:][keep]).float().softmax(-1)
        arg_target = p_target.argmax(-1)
    row = torch.full((B, T), -1, dtype=torch.long, device=ids.device)
    row[keep] = torch.arange(int(keep.sum()), device=ids.device)
    cache = DynamicCache() if unroll > 1 else None  # concatenating, so autograd sees every step
    later = unroll_anchors(T, unroll_fraction, generator) if unroll > 1 else None
    total, info = 0.0, {}
    for s, idx, at, pred in unroll_head(head, ids, inp_f, unroll, cache, later):
        r = row[:, at]
        k = (r >= 0) & (idx + s <= T)
        m = k.float()
        denom = m.sum().clamp_min(1.0)
        if core.predicts_features:
            reg = (F.smooth_l1_loss(pred, feats[:, 1:][:, at], reduction="none").mean(-1) * m).sum() / denom
        else:
            reg = torch.zeros((), device=pred.device)
        # step 1 predicts every loss position, in order: its soft labels need no gather (a copy of
        # a positions x draft-vocabulary matrix)
        p, arg = (p_target, arg_target) if s == 1 else (p_target[r[k]], arg_target[r[k]])
        logits = core.logits(pred[k]).float()
        ce = F.cross_entropy(logits, p, reduction="sum") / denom  # soft labels: -sum p log softmax, fused
        step_loss = reg_weight * reg + ce_weight * ce if core.predicts_features else ce
        total = total + unroll_decay ** (s - 1) * step_loss
        with torch.no_grad():
            acc = (logits.argmax(-1) == arg).float().sum() / denom
        if s == 1:
            info = {"reg": reg.item(), "ce": ce.item(), "acc": acc.item(), "tokens": int(m.sum())}
        else:
            info[f"acc{s}"] = acc.item()
    return total, info


def unroll_head(head: EagleDraftHead, ids: torch.Tensor, x_f: torch.Tensor, steps: int,
                cache: "KVCache | DynamicCache | None" = None,
                later: torch.Tensor | None = None) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Run the head `steps` times the way drafting does; yield (s, anchors, at, prediction) per step.

    ids: (B, T+1) tokens, x_f: (B, T, H) step-1 input features. Anchor j's step s predicts f_{j+s}
    (at = j+s-1, clamped; callers drop j+s > T) from its step s-1 prediction and token t_{j+s} (t_{j+s-1}
    where the head reads unshifted tokens), seeing
    the real prefix up to j and its own chain: the mask gains one diagonal per step. `later` restricts
    steps >= 2 to those anchors (chains are independent). Without a cache the head runs step 1 alone,
    causally.
    """
    B, T = x_f.shape[:2]
    dev = ids.device
    offset = getattr(head, "module", head).token_offset  # t_{j+1}, or t_j for the unshifted ablation
    idx = torch.arange(T, device=dev)
    causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    allowed = causal
    for s in range(1, steps + 1):
        if s == 2 and later is not None:
            idx = later.to(dev)
            x_f, allowed = x_f[:, idx], causal[idx]
        if s >= 2:
            allowed = torch.cat([allowed, torch.eye(idx.numel(), dtype=torch.bool, device=dev)], dim=1)
        at = (idx + s - 1).clamp(max=T - 1)
        attn = float_mask(allowed, x_f.dtype) if cache is not None else None
        pred = head(x_f, ids[:, at + offset], at.expand(B, -1), attn, cache)
        yield s, idx, at, pred
        x_f = pred


def unroll_anchors(T: int, fraction: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """The sorted anchor positions whose unrolled chains train at steps >= 2."""
    if fraction >= 1.0:
        return torch.arange(T)
    n = max(1, round(T * fraction))
    return torch.randperm(T, generator=generator)[:n].sort().values


@torch.no_grad()
def unroll_accuracy(head: EagleDraftHead, seqs: Sequences, n: int, steps: int) -> list[float]:
    """Top-1 agreement of the draft with the target's argmax at unroll steps 1..`steps`.

    The head is fed its own predicted features, as at inference (`unroll_head`, one forward per step
    over all anchors).
    """
    head.eval()
    dev = next(head.parameters()).device
    hit = [0] * steps
    tot = [0] * steps
    lm_full = head.lm_head
    for i in range(min(n, len(seqs.ids))):
        ids, f, msk = seqs.ids[i].to(dev), seqs.feats[i].to(dev).float(), seqs.mask[i].to(dev)
        T = ids.numel() - 1
        if T < 2:
            continue
        target_arg = lm_full(f[:, : head.hidden_size]).argmax(-1)  # (T+1,): the target's greedy next token after each position
        for s, idx, at, out in unroll_head(head, ids[None], f[None, :-1], steps, KVCache(T * steps)):
            pred = head.to_target_ids(head.logits(out[0]).argmax(-1))
            valid = (idx + s <= T) & msk[at + 1]
            hit[s - 1] += int(((pred == target_arg[at + 1]) & valid).sum())
            tot[s - 1] += int(valid.sum())
    head.train()
    return [h / t if t else 0.0 for h, t in zip(hit, tot)]


# -- the loop -----------------------------------------------------------------------------------------
def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def _readable(ck: Path) -> dict | None:
    """A checkpoint's trainer state, or None where the folder is not a whole checkpoint."""
    try:
        state = json.loads((ck / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return None
    whole = isinstance(state, dict) and isinstance(state.get("step"), int) and isinstance(state.get("config"), dict)
    files = all((ck / f).is_file() for f in ("optimizer.pt", "head/config.json", "head/model.safetensors"))
    return state if whole and files else None


def _latest(out: Path) -> Path | None:
    """The checkpoint to resume from: the one `latest` names, or where that one is damaged, the
    newest whole one left (the previous one is kept until a newer one is whole)."""
    ptr = out / "latest"
    if not ptr.is_file():
        return None
    ck = out / ptr.read_text().strip()
    if _readable(ck) is not None:
        return ck
    for older in sorted(out.glob("ckpt-*"), reverse=True):
        if _readable(older) is not None:
            warnings.warn(f"eaglespec: {ck} is damaged; resuming from {older}")
            return older
    raise CheckpointError(f"{ck}: the checkpoint named by {ptr} is incomplete, and no whole one is left; "
                          "start again with --no-resume or another --out")


def train(cfg: TrainConfig, resume: bool = True) -> dict:
    from accelerate import Accelerator

    from ..models import load_target

    cfg.validate()
    acc = Accelerator(cpu=cfg.device == "cpu")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    feats_dirs = [Path(f).expanduser() for f in cfg.features.split(",") if f]  # the shell expands only the first ~
    target, tok = load_target(cfg.model, device=str(acc.device))
    for p in target.parameters():
        p.requires_grad_(False)
    aux_layers = parse_layers(cfg.aux_layers) or (read_head_config(Path(cfg.init)).get("aux_layers") or []
                                                   if cfg.init else [])
    if cfg.arch == "eagle3" and not aux_layers:
        aux_layers = eagle3_default_aux_layers(target.config.num_hidden_layers)
    train_set = load_split(*(d / "train" for d in feats_dirs), aux_layers=aux_layers)
    held = load_split(feats_dirs[0] / "heldout", aux_layers=aux_layers)
    if train_set.width != target.config.hidden_size * (1 + len(aux_layers)):
        raise EaglespecError(f"features in {cfg.features} have width {train_set.width}, the target {cfg.model} "
                             f"has hidden size {target.config.hidden_size}")

    ck = _latest(out) if resume else None
    if ck is not None:
        head = EagleDraftHead.from_pretrained(ck / "head", target)
        state = _readable(ck)
        # a field added after the checkpoint was written counts as its default
        was = {**asdict(TrainConfig(features="", out="")), **state["config"]}
        if was != asdict(cfg):
            diff = {k: (was.get(k), v) for k, v in asdict(cfg).items() if was.get(k) != v}
            if "epochs" in diff:  # the learning-rate schedule spans every epoch: another count is another run
                raise EaglespecError(f"{out} was trained with --epochs {diff['epochs'][0]}; resume with the same "
                                     "(--max-steps stops early), or start another --out")
            if set(diff) - {"max_steps", "save_every"}:
                raise EaglespecError(f"{out} was trained with other settings {diff}; use another --out")
    else:
        torch.manual_seed(cfg.seed)
        if cfg.init:
            head = EagleDraftHead.from_pretrained(cfg.init, target)  # checks that it fits the target
            if head.arch != cfg.arch:
                raise EaglespecError(f"{cfg.init} has arch {head.arch}; --arch {cfg.arch} would train another "
                                     "architecture: start it without --init")
            if head.input_mode != cfg.input_mode:
                raise EaglespecError(f"{cfg.init} reads {head.input_mode}; --input-mode {cfg.input_mode} would "
                                     "train another head: start it without --init")
            head.grow(max(cfg.layers, head.num_layers))  # new layers start as the identity
            head.add_aux_layers(aux_layers)  # a new fusion starts at zero
            size = 0 if head.d2t is None else head.d2t.numel()
            want = size if cfg.draft_vocab < 0 else cfg.draft_vocab
            if cfg.revocab:  # the weights do not depend on the vocabulary
                d2t = draft_vocabulary(train_set.token_counts, want, eos_ids(tok, target),
                                       fill=None if head.d2t is None else head.d2t.tolist())
                if d2t is None:
                    raise EaglespecError(f"{cfg.init}: a draft vocabulary of {want or 'all'} tokens is the full "
                                         "vocabulary: there is no draft vocabulary to rebuild (give --draft-vocab N)")
                head.set_draft_vocab(d2t)
            elif want != size:
                raise EaglespecError(f"--draft-vocab {want}: {cfg.init} drafts over {size or 'all'} tokens; add "
                                     "--revocab to rebuild its vocabulary at that size from this run's data")
        else:
            always = eos_ids(tok, target)
            d2t = draft_vocabulary(train_set.token_counts, 8192 if cfg.draft_vocab < 0 else cfg.draft_vocab, always)
            # eagle1 and eagle3 heads have a Llama layer whatever the target, as every engine that reads them expects
            layer_of = target.config if cfg.arch == "hybrid" else llama_layer_config(target.config)
            if cfg.intermediate_size:
                layer_of = copy.deepcopy(layer_of)  # the target's own config stays as it is
                layer_of.intermediate_size = cfg.intermediate_size
            head = EagleDraftHead(layer_of, input_mode=cfg.input_mode, draft_vocab=d2t, num_layers=max(1, cfg.layers),
                                  aux_layers=aux_layers, arch=cfg.arch, model_type=target.config.model_type).bind(target)
            head.warm_start(target)
        state = {"step": 0, "log": [], "evals": [], "config": asdict(cfg), "train_time_s": 0.0, "tokens_seen": 0}
        if cfg.init and acc.is_main_process:  # the baseline this run must beat, on the same held-out set
            accs = unroll_accuracy(head, held, cfg.eval_conversations, cfg.eval_steps)
            state["evals"].append({"step": 0, "epoch": -1, "unroll_acc": accs})
            tqdm.write(f"--init head: held-out step-1..{cfg.eval_steps} accuracy " + " ".join(f"{a:.3f}" for a in accs))
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if ck is not None:
        try:
            opt.load_state_dict(torch.load(ck / "optimizer.pt", weights_only=True))
        except Exception as e:  # a damaged or foreign file must not surface as a torch traceback
            raise CheckpointError(f"{ck / 'optimizer.pt'}: unreadable optimizer state ({e})") from None
    head_p, opt_p = acc.prepare(head, opt)

    lengths = [x.numel() for x in train_set.ids]
    per_epoch = [epoch_batches(lengths, cfg.batch_tokens, cfg.seed, e) for e in range(cfg.epochs)]
    schedule = [(e, b) for e in range(cfg.epochs) for b in per_epoch[e]]
    # every process takes the same number of batches: a step's gradients are averaged across them,
    # and one with a step more would wait for the others forever (the last few batches are dropped)
    schedule = schedule[acc.process_index::acc.num_processes][: len(schedule) // acc.num_processes]
    total = len(schedule)  # the LR schedule spans all epochs; max_steps only stops early
    stop = min(cfg.max_steps, total) if cfg.max_steps else total
    step = state["step"]
    bar = tqdm(total=stop, initial=step, desc="train", unit="step", dynamic_ncols=True,
               disable=not acc.is_main_process)
    t_start = time.perf_counter()
    time_before = state["train_time_s"]
    while step < stop:
        epoch, idx = schedule[step]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, cfg)
        ids, feats, mask = collate(train_set, idx, str(acc.device))
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)  # resumable noise
        with torch.autocast(acc.device.type, dtype=DTYPES[cfg.dtype], enabled=DTYPES[cfg.dtype] != torch.float32):
            loss, info = eagle_loss(head_p, ids, feats, mask, cfg.noise, cfg.ce_weight, gen, cfg.unroll,
                                     cfg.unroll_decay, cfg.unroll_fraction, cfg.reg_weight)
        opt_p.zero_grad(set_to_none=True)
        acc.backward(loss)
        acc.clip_grad_norm_(head_p.parameters(), cfg.grad_clip)
        opt_p.step()
        step += 1
        state["tokens_seen"] += info["tokens"]
        elapsed = time_before + time.perf_counter() - t_start
        state["log"].append({"step": step, "epoch": epoch, "loss": loss.item(), **info, "lr": opt.param_groups[0]["lr"],
                             "time_s": elapsed})
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{info['acc']:.3f}",
                        tok_s=f"{state['tokens_seen'] / max(elapsed, 1e-9):.0f}")
        end_of_epoch = step == stop or schedule[step][0] != epoch
        if end_of_epoch and acc.is_main_process:
            accs = unroll_accuracy(acc.unwrap_model(head_p), held, cfg.eval_conversations, cfg.eval_steps)
            state["evals"].append({"step": step, "epoch": epoch, "unroll_acc": accs})
            tqdm.write(f"epoch {epoch} step {step}: held-out step-1..{cfg.eval_steps} accuracy "
                       + " ".join(f"{a:.3f}" for a in accs))
        if acc.is_main_process and (step % cfg.save_every == 0 or end_of_epoch):
            state["step"] = step
            state["train_time_s"] = time_before + time.perf_counter() - t_start
            save_checkpoint(out, acc.unwrap_model(head_p), opt, state)
    bar.close()
    if acc.is_main_process:
        final = acc.unwrap_model(head_p)
        final.metadata = {"train_config": _portable(asdict(cfg)), "steps": step, "tokens_seen": state["tokens_seen"],
                          "train_time_s": state["train_time_s"], "evals": state["evals"]}
        if cfg.init:  # the runs behind the head this run continued, oldest first
            final.metadata["history"] = training_history(read_training_record(Path(cfg.init)))
        final.save_pretrained(out / "head")
        plot_curves(state, out / "curves.png")
    return state


def training_history(metadata: dict) -> list[dict]:
    """Every training run behind a head, oldest first, each its own metadata without history.

    Kept flat so a head continued many times carries one list, not a nesting as deep as its runs;
    heads written before `history` existed nest their past under `init_metadata` and unfold here."""
    if not metadata:
        return []
    own = {k: v for k, v in metadata.items() if k not in ("history", "init_metadata")}
    past = metadata.get("history") or training_history(metadata.get("init_metadata", {}))
    return [*past, own]


def _portable(config: dict) -> dict:
    """A training config as shipped head metadata: its paths without this machine's prefixes."""
    return {k: ",".join(short_path(p) for p in v.split(",")) if k in ("features", "out", "init") and v else v
            for k, v in config.items()}


def save_checkpoint(out: Path, head: EagleDraftHead, opt: torch.optim.Optimizer, state: dict) -> None:
    """Write ckpt-<step>/ completely (every file flushed to disk), check it reads back whole, flip the
    `latest` pointer atomically, then drop all but it and the one before it."""
    name = f"ckpt-{state['step']:07d}"
    ptr = out / "latest"
    previous = ptr.read_text().strip() if ptr.is_file() else None
    ck = out / name
    if ck.exists():
        shutil.rmtree(ck)
    head.save_pretrained(ck / "head")
    atomic_torch_save(opt.state_dict(), ck / "optimizer.pt")
    atomic_write_json(state, ck / "trainer_state.json")
    if _readable(ck) is None:
        raise CheckpointError(f"{ck}: written but does not read back whole")
    atomic_write_text(name + "\n", ptr)
    atomic_write_json({"log": state["log"], "evals": state["evals"], "tokens_seen": state["tokens_seen"],
                       "train_time_s": state["train_time_s"]}, out / "train_log.json")
    for old in out.glob("ckpt-*"):
        if old.name not in (name, previous):
            shutil.rmtree(old, ignore_errors=True)


def plot_curves(state: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = state["log"]
    if not log:
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    steps = [r["step"] for r in log]
    for ax, key in zip(axes[:2], ("loss", "acc")):
        ax.plot(steps, [r[key] for r in log], lw=0.6, alpha=0.5)
        k = max(1, len(log) // 50)
        smooth = [sum(r[key] for r in log[max(0, i - k):i + 1]) / len(log[max(0, i - k):i + 1]) for i in range(len(log))]
        ax.plot(steps, smooth, lw=1.5)
        ax.set_title(f"train {key}")
        ax.set_xlabel("step")
    for ev in state["evals"]:
        axes[2].plot(range(1, len(ev["unroll_acc"]) + 1), ev["unroll_acc"], marker="o", label=f"step {ev['step']}")
    axes[2].set_title("held-out accuracy by unroll step")
    axes[2].set_xlabel("draft step")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
