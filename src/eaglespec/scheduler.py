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
    started: float = 0.0  # when it joined a batch (perf_counter)

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
        # the jobs taken from the queue and not finished (changed only by the decode thread; a job
        # leaves before its last event is sent, so a client that has its answer never counts here)
        self.active: dict[int, Job] = {}
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
            return {"running": len(self.active), "waiting": len(self.waiting)}

    def close(self) -> None:
        """Stop the thread; unfinished jobs get `ServerClosing`."""
        with self.cond:
            self.stopped = True
            self.cond.notify()
        self.thread.join(timeout=60)

    def _admit(self) -> list[Job]:
        """Move waiting jobs to the running ones, in arrival order, while they can share the batch
        (call with the lock held); returns those that joined."""
        out = []
        while self.waiting and len(self.active) < self.max_batch:
            job = self.waiting[0]
            if job.cancelled.is_set():
                self.waiting.popleft()
                continue
            if self.active and job.group != next(iter(self.active.values())).group:
                break  # it waits for the batch to drain, and so does everyone behind it
            self.active[job.key] = self.waiting.popleft()
            out.append(job)
        return out

    def _finish(self, job: Job, last: tuple[list[int], str] | BaseException) -> None:
        del self.active[job.key]  # before the client hears it is done
        job.events.put(last)

    def _loop(self) -> None:
        cb: ContinuousBatch | None = None
        while True:
            with self.cond:
                while not self.stopped and not self.waiting and not self.active:
                    self.cond.wait()
                if self.stopped:
                    for job in list(self.waiting) + list(self.active.values()):
                        job.events.put(ServerClosing("the server is shutting down"))
                    self.waiting.clear()
                    self.active.clear()
                    return
                joining = self._admit()
            for job in joining:
                try:
                    if cb is None:
                        cb = ContinuousBatch(self.engine, job.sampling, self.method, self.eos, self.batch, job.seed)
                    cb.add(job.key, job.prompt_ids, job.max_tokens, job.stats)
                    job.started = time.perf_counter()
                except EaglespecError as e:
                    self._finish(job, e)
            for job in list(self.active.values()):
                if job.cancelled.is_set():
                    cb.cancel(job.key)
                    del self.active[job.key]
            if self.active:
                try:
                    events = cb.step()
                except Exception as e:  # noqa: BLE001 (every running request fails; the server goes on)
                    print(f"eaglespec: decoding failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                    for job in list(self.active.values()):
                        self._finish(job, e)
                    events = []
                for key, new, reason in events:
                    job = self.active.get(key)
                    if job is None:
                        continue
                    if reason is None:
                        job.events.put((new, None))
                        continue
                    self._job_s = 0.8 * self._job_s + 0.2 * (time.perf_counter() - job.started)
                    self._finish(job, (new, reason))
            if not self.active:
                cb = None  # the next request starts a batch of its own group
