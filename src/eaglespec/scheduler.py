"""The server's decode thread: requests wait in a bounded first-come, first-served queue and decode
together in one `ContinuousBatch`.

Each request is a `Job` with its own event queue: the decode thread puts tokens there and never
touches a socket, so a client that reads slowly (or not at all) delays nobody but itself. Requests
that can share a batch (the same sampling parameters, no seed) join the running one at a round
boundary, up to `max_batch` of them; the first request that cannot share it waits, and everything
behind it waits too (arrival order is kept). A cancelled job leaves at the next round; a full queue
refuses new work (`QueueFull`) instead of letting waits grow without bound.
"""

from __future__ import annotations

import itertools
import math
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .errors import EaglespecError
from .models import Engine
from .spec import ContinuousBatch, GenerationStats
from .spec.verify import SamplingParams

POLL_S = 0.25  # how often a waiting client's connection is checked while no token comes


class QueueFull(EaglespecError):
    """The queue is at its limit; `retry_after` estimates the seconds until there is room."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ServerClosing(EaglespecError):
    """The scheduler stopped before the request finished."""


@dataclass(eq=False)
class Job:
    """One request's decode: what to decode, and the events the decode thread sends back (token
    lists with the finish reason once it is known, or an exception)."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int | None
    key: int
    stats: GenerationStats = field(default_factory=GenerationStats)
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop decoding (at the next round boundary); no-op once finished."""
        self.cancelled.set()

    def tokens(self, alive: Callable[[], bool] = lambda: True) -> Iterator[tuple[list[int], str | None]]:
        """(new token ids, finish reason or None) as they are decoded, until the finish reason.
        `alive()` is asked after each event and every `POLL_S` while none comes: False cancels the
        job and ends."""
        while True:
            try:
                item = self.events.get(timeout=POLL_S)
            except queue.Empty:
                item = None
            if isinstance(item, BaseException):
                raise item
            if item is not None:
                yield item
                if item[1] is not None:
                    return
            if not alive():
                self.cancel()
                return

    @property
    def group(self) -> tuple:
        """Jobs with equal groups can share a batch: one sampling law and one random stream serve
        it, so a seeded job decodes alone (its seed then reproduces its text)."""
        sp = self.sampling
        if self.seed is not None and not sp.greedy:
            return ("seeded", self.key)
        return ("greedy",) if sp.greedy else (sp.temperature, sp.top_p, sp.top_k)


class Scheduler:
    """The decode thread and its queue (see the module's docstring). `batch`: the engine several
    running requests draft with (a static tree; None: plain batched steps)."""

    def __init__(self, engine: Engine, method: str, eos: list[int], batch: Engine | None = None,
                 max_batch: int = 8, max_queue: int = 64) -> None:
        if max_batch < 1 or max_queue < 1:
            raise EaglespecError("max_batch and max_queue must be >= 1")
        self.engine, self.method, self.eos, self.batch = engine, method, eos, batch
        self.max_batch, self.max_queue = max_batch, max_queue
        self.cond = threading.Condition()
        self.waiting: deque[Job] = deque()
        self.running = 0
        self.stopped = False
        self._keys = itertools.count()
        self._job_s = 1.0  # a decayed mean of how long a request decodes, for Retry-After
        self.thread = threading.Thread(target=self._loop, name="eaglespec-decode", daemon=True)
        self.thread.start()

    def submit(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams,
               seed: int | None = None) -> Job:
        """Queue a request (`QueueFull` when the queue is at its limit)."""
        with self.cond:
            if self.stopped:
                raise ServerClosing("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                batches = math.ceil((len(self.waiting) + 1) / self.max_batch)
                raise QueueFull(f"the server is busy ({len(self.waiting)} requests waiting); retry later",
                                max(1, math.ceil(batches * self._job_s)))
            job = Job(list(prompt_ids), max_tokens, sampling, seed, next(self._keys))
            self.waiting.append(job)
            self.cond.notify()
        return job

    def load(self) -> dict[str, int]:
        with self.cond:
            return {"running": self.running, "waiting": len(self.waiting)}

    def close(self) -> None:
        """Stop the thread; unfinished jobs get `ServerClosing`."""
        with self.cond:
            self.stopped = True
            self.cond.notify()
        self.thread.join(timeout=60)

    def _admit(self, active: dict[int, Job], group: tuple | None) -> list[Job]:
        """The waiting jobs that join now, in arrival order (call with the lock held)."""
        out = []
        while self.waiting and len(active) + len(out) < self.max_batch:
            job = self.waiting[0]
            if job.cancelled.is_set():
                self.waiting.popleft()
                continue
            if (active or out) and job.group != (group if active else out[0].group):
                break  # it waits for the batch to drain, and so does everyone behind it
            out.append(self.waiting.popleft())
        return out

    def _loop(self) -> None:
        cb: ContinuousBatch | None = None
        group: tuple | None = None
        active: dict[int, Job] = {}
        started: dict[int, float] = {}
        while True:
            with self.cond:
                while not self.stopped and not self.waiting and not active:
                    self.cond.wait()
                if self.stopped:
                    for job in list(self.waiting) + list(active.values()):
                        job.events.put(ServerClosing("the server is shutting down"))
                    self.waiting.clear()
                    return
                joining = self._admit(active, group)
                self.running = len(active) + len(joining)
            for job in joining:
                try:
                    if cb is None:
                        cb = ContinuousBatch(self.engine, job.sampling, self.method, self.eos, self.batch, job.seed)
                        group = job.group
                    cb.add(job.key, job.prompt_ids, job.max_tokens, job.stats)
                    active[job.key] = job
                    started[job.key] = time.perf_counter()
                except EaglespecError as e:
                    job.events.put(e)
            for key, job in list(active.items()):
                if job.cancelled.is_set():
                    cb.cancel(key)
                    del active[key]
                    started.pop(key)
            if not active:
                cb = None
                with self.cond:
                    self.running = 0
                continue
            try:
                events = cb.step()
            except Exception as e:  # noqa: BLE001 (every running request fails; the server goes on)
                print(f"eaglespec: decoding failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                for job in active.values():
                    job.events.put(e)
                active.clear()
                started.clear()
                cb = None
                with self.cond:
                    self.running = 0
                continue
            for key, new, reason in events:
                job = active.get(key)
                if job is None:
                    continue
                if reason is not None:
                    del active[key]
                    with self.cond:  # before the client hears it is done
                        self.running = len(active)
                job.events.put((new, reason))
                if reason is not None:
                    self._job_s = 0.8 * self._job_s + 0.2 * (time.perf_counter() - started.pop(key))
            if not active:
                cb = None  # the next request starts a batch of its own group
            with self.cond:
                self.running = len(active)
