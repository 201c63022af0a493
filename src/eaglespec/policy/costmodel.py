"""What one EAGLE round costs on this machine.

The paper's trees assume a GPU, where verifying 26 tokens costs about as much as one. On a CPU
the target's forward time grows with the number of tokens verified, so the best tree depends on
the machine. The target's forward time for 1..64 tokens and the time of one draft level are
measured once per (model, kernels, machine, threads, torch version) and cached as JSON
(`CostProfile`); `LiveCosts` refits the curve to the forwards an engine times, and `DraftGate`
compares drafted rounds with plain steps. `auto.AutoPolicy` uses them to size each round.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..io import atomic_write_json
from ..platform import cache_root, cpu_kind
from ..spec.cache import KVCache
from ..spec.tree import float_mask

if TYPE_CHECKING:
    from ..spec.engine import Engine

DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)


@dataclass
class CostProfile:
    sizes: list[int]  # tokens per target forward
    verify_s: list[float]  # median seconds of target forward + LM head for that many tokens
    draft_level_s: float  # median seconds of one draft level (head forward + draft LM head + top-k)
    context: int  # cached tokens the measurement ran against
    machine: dict

    def verify(self, n: int) -> float:
        """Piecewise-linear in n; extrapolated from the last two points beyond the largest size.
        Memoised: `auto` asks thousands of times per generation (a profile is not changed once made)."""
        memo = self.__dict__.setdefault("_memo", {})
        if n not in memo:
            memo[n] = self._interpolate(n)
        return memo[n]

    def _interpolate(self, n: int) -> float:
        xs, ys = self.sizes, self.verify_s
        if n <= xs[0]:
            return ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if n <= x1:
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = (xs[-2], ys[-2]), (xs[-1], ys[-1])
        return y1 + (y1 - y0) * (n - x1) / (x1 - x0)

    def best_size(self, gains: list[float], fixed_s: float) -> tuple[int, float]:
        """gains: expected extra accepted tokens of each candidate node, best first. Returns (m, rate):
        verifying the root plus the first m candidates maximises (1 + sum gains[:m]) / (fixed_s + verify(m + 1))."""
        best_m, best_rate, expected = 0, 1.0 / (fixed_s + self.verify(1)), 1.0
        for m, g in enumerate(gains, start=1):
            expected += g
            rate = expected / (fixed_s + self.verify(m + 1))
            if rate > best_rate:
                best_m, best_rate = m, rate
        return best_m, best_rate

    def save(self, path: Path) -> None:
        atomic_write_json(asdict(self), path)

    @classmethod
    def load(cls, path: Path) -> "CostProfile":
        return cls(**json.loads(Path(path).read_text()))


def machine_info(engine: "Engine") -> dict:
    """What sets a round's costs: the model, the machine, and what the backend made of both."""
    cfg = engine.model.config
    cpu = cpu_kind()
    if engine.device.type == "cuda":
        cpu = torch.cuda.get_device_name(engine.device)
    head = engine.head
    info = {"model": getattr(cfg, "_name_or_path", "") or cfg.model_type, "hidden": cfg.hidden_size,
            "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size, "dtype": str(engine.dtype),
            "device": str(engine.device), "quantization": None, "kernels": None,
            "processor": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "head_vocab": head.draft_vocab_size if head is not None else 0}
    info.update(engine.backend.describe(engine.model, head))
    if getattr(engine.decoder, "_compiled_call_impl", None) is not None:  # compiled kernels cost otherwise
        info["compiled"] = True
    if head is not None and head.num_layers > 1:  # a deeper head drafts slower
        info["head_layers"] = head.num_layers
    return info


def profile_path(engine: "Engine") -> Path:
    key = hashlib.sha256(json.dumps(machine_info(engine), sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "costs" / f"{key}.json"


@torch.inference_mode()
def time_forward(engine: "Engine", cache: "KVCache", context: int, tokens: list[int]) -> float:
    """Seconds for one target forward of `tokens` after `context` cached ones, as a tree would send
    them (a mask, logits of every row), then the cache back at `context`."""
    n = len(tokens)
    allowed = torch.ones(n, context + n, dtype=torch.bool, device=engine.device).tril(context)
    t0 = engine.clock()
    feats = engine.target_forward(tokens, context, cache, float_mask(allowed, engine.dtype))
    engine.backend.argmax(engine.lm_head(feats))
    dt = engine.clock() - t0
    cache.crop(context)
    return dt


@torch.inference_mode()
def measure(engine: "Engine", sizes: tuple[int, ...] = DEFAULT_SIZES, context: int = 256, repeats: int = 5,
            top_k: int = 4) -> CostProfile:
    """Time the target on `sizes` tokens after a `context`-token prefix, sizes interleaved per repeat.
    Under inference mode whoever calls: with autograd on, a head with trainable weights drafts ~4x
    slower (and `auto` would size its trees by that)."""
    context = min(context, engine.max_context - max(sizes) - 1)
    vocab = engine.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (context,), generator=g).tolist()
    cache = KVCache(context + max(sizes))
    engine.target_forward(prompt, 0, cache)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats + 1):  # the first pass warms up
        for n in sizes:
            times[n].append(time_forward(engine, cache, context, torch.randint(0, vocab, (n,), generator=g).tolist()))
    verify = [statistics.median(times[n][1:]) for n in sizes]

    draft = 0.0
    if engine.head is not None:
        head, h = engine.head, engine.model.config.hidden_size
        hcache = KVCache(context + 2 * top_k)
        f = torch.randn(1, context, h, generator=g).to(engine.device, engine.dtype)
        pos = torch.arange(context, device=engine.device)[None]
        head(f, torch.tensor([prompt], device=engine.device), pos, cache=hcache)
        dt = []
        for _ in range(repeats + 1):
            t0 = engine.clock()
            # a level as the engine drafts it: in one call where the backend has one (`draft_step`)
            plan = engine.backend.rows_plan(context, [[j] for j in range(top_k)])
            step = None if plan is None else engine.backend.draft_step(head, f[:, :top_k], prompt[:top_k],
                                                                       [context] * top_k, hcache, plan, top_k)
            if step is None:
                allowed = torch.ones(top_k, context + top_k, dtype=torch.bool, device=engine.device)
                out = head(f[:, :top_k], torch.tensor([prompt[:top_k]], device=engine.device),
                           torch.full((1, top_k), context, device=engine.device), float_mask(allowed, engine.dtype),
                           hcache)
                torch.topk(torch.log_softmax(head.logits(out[0]).float(), -1), top_k, dim=-1).indices.tolist()
            dt.append(engine.clock() - t0)
            hcache.crop(context)
        draft = statistics.median(dt[1:])
    return CostProfile(list(sizes), verify, draft, context, machine_info(engine))


class LiveCosts:
    """The cost curve as this engine's own forwards find it. A curve is a snapshot: measured at one
    context, between forwards of every other size, on a host whose memory bandwidth can move by
    1.5x from hour to hour, so it can be off by 1.5x at the step and 2x per extra node. So every timed forward of n tokens
    refits verify(n) = a + b (n - 1) by least squares over recent forwards (decayed). The curve's
    own line (over sizes up to 16) is the prior: worth `prior` forwards at the level, and a ridge
    on b that holds the slope while rounds keep verifying one size. A line, not the curve's shape: on
    CPU a forward's cost grows about linearly with its tokens, and the shape was what went wrong."""

    def __init__(self, profile: CostProfile, decay: float = 0.95, prior: float = 0.5):
        self.profile, self.decay, self.prior = profile, decay, prior
        self.draft_level_s = profile.draft_level_s
        pts = [(n - 1.0, profile.verify(n)) for n in profile.sizes if n <= 16]
        mx, my = (sum(v) / len(pts) for v in zip(*pts))
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        self.b0 = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx > 0 else 0.0
        self.a0 = my - self.b0 * mx
        self._sums = [0.0] * 5  # decayed weight, sum x, sum x^2, sum y, sum x y (x = n - 1, y = seconds)
        self.a, self.b = self.a0, self.b0

    def _fit(self) -> None:
        w, sx, sxx, sy, sxy = self._sums
        mx, my = sx / w, sy / w
        b = (sxy - sx * my + self.prior * self.b0) / (sxx - sx * mx + self.prior)
        self.b = max(b, 0.0)  # more tokens never cost less
        # the level where the forwards were timed: theirs, with the prior's line worth `prior` forwards
        level = (w * my + self.prior * (self.a0 + self.b0 * mx)) / (w + self.prior)
        self.a = max(level - self.b * mx, 1e-9)

    def observe(self, n: int, seconds: float) -> None:
        x, d = n - 1.0, self.decay
        self._sums = [d * s + v for s, v in zip(self._sums, (1.0, x, x * x, seconds, x * seconds))]
        self._fit()

    def verify(self, n: int) -> float:
        return self.a + self.b * (n - 1)

    best_size = CostProfile.best_size


def within_2x(seconds: float, modelled: float) -> float:
    """A clock time trusted within a factor of two of what the cost curve predicts."""
    return min(max(seconds, modelled / 2), 2 * modelled)


class DraftGate:
    """`auto`'s tree of size zero: no draft at all this round. Where a multi-token forward is
    arithmetic-bound (int4-q8 on 2 cores at T = 1: 1.7 tokens per 7.7 ms round against a 3.8 ms
    step), a drafted round brings fewer tokens per second than a plain step. Both sides are timed by
    the clock, the whole round with its bookkeeping, trusted within 2x of the cost curve either way
    (a process's first rounds pay one-off costs). The curve alone misleads (one measured on a busy
    host can overstate a step by a third and make a losing draft look like a win), so the gate
    times plain steps itself: `warmup` of them once `warmup` drafted rounds are
    in, then one every `refresh` drafted rounds. A round that first feeds the head a backlog (the
    prompt, or the plain steps' tokens) is not counted: its feed, and a new prompt's one-off costs
    (1-2 ms more at int4-q8, beyond the feed), are the switch's, not drafting's. Decayed sums; once
    they hold `keep` rounds' weight and drafted rounds lose by more than `margin`, the gate shuts:
    `pause` plain steps (vanilla's: lossless as ever), then drafted rounds probe again. A round's
    tokens are noisy (at T = 1 one round in five brings twice the mean), so a probe is judged with
    the rounds before it (plain steps fade them, down to `keep` rounds' weight) and reopens the
    gate only where drafting wins outright; one that does not doubles the pause (up to
    `max_pause`). Winning rounds halve it again, down to `pause`: a lucky probe that
    reopens the gate for a round or two leaves the long pause in place. A new prompt opens the gate
    again (`new_text`): a text where drafting lost says little about the next one (the pause it
    grew is kept). The margin is wide (20 %) because rounds are noisy and drafting is cheap: a
    narrower one pauses rounds that win on average."""

    def __init__(self, profile: CostProfile, decay: float = 0.9, warmup: int = 4, pause: int = 4,
                 max_pause: int = 32, refresh: int = 64, margin: float = 0.8, keep: float = 3.0):
        self.profile, self.decay, self.warmup, self.base, self.max_pause = profile, decay, warmup, pause, max_pause
        self.refresh, self.margin, self.keep = refresh, margin, keep
        self.tokens = self.cost = self.rounds = 0.0  # decayed sums over drafted rounds
        self.shut = False  # drafting lost: the next drafted round is a probe
        self.plain_steps = self.plain_cost = 0.0  # and over plain steps
        self.drafted, self.pause, self.skip, self.since_plain = 0, pause, 0, 0

    def new_text(self) -> None:
        """A new prompt: what drafting brought on the last text says little about this one (a poem
        and a program differ by 2x in acceptance), so its rounds are forgotten and the gate opens;
        what a plain step costs is kept, and so is the pause: where drafting lost on text after text,
        probes stay rare."""
        self.tokens = self.cost = self.rounds = 0.0
        self.skip, self.shut = 0, False

    def draft(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return False
        if self.drafted >= self.warmup and (not self.plain_steps or self.since_plain >= self.refresh):
            self.skip = (self.warmup if not self.plain_steps else 1) - 1
            return False
        return True

    def rate(self) -> float:
        """Tokens per second of recent drafted rounds."""
        return self.tokens / self.cost if self.cost > 0 else float("inf")

    def plain_rate(self) -> float:
        """Tokens per second of recent plain steps (the curve's step until some ran)."""
        return self.plain_steps / self.plain_cost if self.plain_steps else 1.0 / self.profile.verify(1)

    def observe_plain(self, seconds: float) -> None:
        """A plain step (the gate was shut) and the seconds it took, timed as drafted rounds are."""
        one = self.profile.verify(1)
        self.since_plain = 0
        self.plain_steps = self.decay * self.plain_steps + 1
        self.plain_cost = self.decay * self.plain_cost + within_2x(seconds, one)
        # the text moves on while the gate is shut, so the rounds that shut it fade, but a probe
        # (one noisy round) is still judged with `keep` rounds' worth of them
        f = max(self.decay, min(1.0, self.keep / self.rounds)) if self.rounds else 1.0
        self.tokens, self.cost, self.rounds = f * self.tokens, f * self.cost, f * self.rounds

    def observe(self, tokens: int, levels: int, nodes: int, seconds: float, backlog: bool = False) -> None:
        """A drafted round: tokens emitted, draft levels run, nodes verified (the root included), the
        seconds it took, and whether the head first caught up on a backlog (then it is not counted)."""
        self.drafted += 1
        self.since_plain += 1
        if backlog:
            return
        d = self.decay
        # the head ran at least once, even where it drafted nothing worth verifying
        modelled = max(levels, 1) * self.profile.draft_level_s + self.profile.verify(nodes)
        self.tokens = d * self.tokens + tokens
        self.cost = d * self.cost + within_2x(seconds, modelled)
        self.rounds = d * self.rounds + 1
        if self.drafted < self.warmup or self.rounds < self.keep:
            return
        # switching costs a backlog feed and probes: drafting must lose clearly before the gate
        # shuts, and win before it reopens
        if self.rate() < self.plain_rate() * (1.0 if self.shut else self.margin):
            self.skip, self.pause, self.shut = self.pause, min(2 * self.pause, self.max_pause), True
        else:
            self.pause, self.shut = max(self.base, self.pause // 2), False


def load_or_measure(engine: "Engine", path: Path | None = None, verbose: bool = True) -> CostProfile:
    """The cached profile for this engine's (model, dtype, machine), measured and cached when absent.
    How far it is from real rounds matters less than it did: `LiveCosts` refits it as they run."""
    path = Path(path) if path is not None else profile_path(engine)
    if path.is_file():
        try:
            return CostProfile.load(path)
        except (ValueError, TypeError, KeyError):
            pass  # a stale or damaged profile is simply measured again
    if verbose:
        print(f"eaglespec: measuring this machine's cost curve once (cached in {path}) ...", file=sys.stderr)
    t0 = time.perf_counter()
    prof = measure(engine)
    prof.machine["measure_time_s"] = time.perf_counter() - t0
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.save(path)
    return prof


def plot(profiles: "CostProfile | dict[str, CostProfile]", path: Path) -> None:
    """The cost curve (target forward vs tokens, and one draft level) of one profile, or several
    labelled ones on the same axes (e.g. fp32 / packed / int4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if isinstance(profiles, CostProfile):
        profiles = {"": profiles}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (label, prof) in enumerate(profiles.items()):
        color = f"C{k}"
        name = f"{label}: " if label else ""
        ax.plot(prof.sizes, [1000 * t for t in prof.verify_s], marker="o", ms=3, color=color,
                label=f"{name}target forward + LM head")
        ax.axhline(1000 * prof.draft_level_s, color=color, ls="--", lw=1, label=f"{name}one draft level (head)")
    first = next(iter(profiles.values()))
    ax.set_xlabel("tokens verified in one forward")
    ax.set_ylabel("ms")
    top = max(max(p.verify_s) for p in profiles.values())
    low = min(min(min(p.verify_s), p.draft_level_s) for p in profiles.values())
    if top > 30 * low:
        ax.set_yscale("log")  # curves an order of magnitude apart (e.g. a slow int8 kernel)
    else:
        ax.set_ylim(bottom=0)
    ax.set_title(f"cost curve: {Path(str(first.machine.get('model', ''))).name}\n{first.machine.get('processor', '')}, "
                 f"{first.machine.get('threads')} threads, context {first.context}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
