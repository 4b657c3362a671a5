"""The batching queue: one path's waiting requests, its lock, and the rules that say
which of them make the next batch and when; and the cores' batch slots every path shares.

    a path's caller ─▶ BatchQueue.admit (bound, count) ─▶ add: one FIFO per priority
                       level; True when a driver may now act (first arrival, a batch
                       just filled, a preferred size reached)
    the path's driver ─▶ due(free): (rows to take, wait): a full batch now; on a free
                       core once the oldest waited the delay, or at once if nothing
                       runs anywhere (unless wait_when_idle); preferred sizes first;
                       a partial batch held while the callers just answered are on
                       their way back (answered / arrive, the threads' path)
                       ─▶ take(limit, accept): level 1 first, FIFO within a level,
                       stopping at the first that does not fit
    CoreSlots ◀─ claim / release: the batches each replica holds, for every path of
                 the server at once; a release pokes the other paths that wait

A server has one BatchQueue per path (its threads, each event loop that calls it:
threads.py, loop.py), so no path's callers wait on another's hand-off, and one
CoreSlots across them, so ``batches_per_core`` bounds what a core holds whoever
sent it.  Lock order: a queue's lock, then the slots' (never the other way).
Pure logic and counters: no threads, no waiting, no I/O.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Deque, List, Optional, Tuple

from ..errors import QueueFullError
from .config import QueuePolicy, Rules
from .lock import QueueLock

__all__ = ["BatchQueue", "CoreSlots", "Request", "pending", "start_future"]


class Request:
    """One caller's inputs (one sample each if ``single``, else rows), its future,
    its clock and its queue (``level``: 0 is the highest priority)."""

    __slots__ = ("inputs", "rows", "single", "future", "arrival", "deadline", "timeout",
                 "queued", "level", "timer", "into", "raw")

    def __init__(self, inputs, rows, single, timeout, future, level=0):
        self.inputs = inputs
        self.rows = rows
        self.single = single
        self.future = future
        self.arrival = time.monotonic()
        self.timeout = timeout
        self.deadline = None if timeout is None else self.arrival + timeout
        self.queued = True
        self.level = level
        self.timer = None  # its deadline's handle on an event loop's path
        self.into = None   # its Destination, written when its batch is its rows alone
        self.raw = None    # its RowInput when ``inputs`` is one input's bytes (rowbytes.py)


class CoreSlots:
    """The batches each replica (an index into the model's cores) holds now, for
    every path of one server; ``per_replica`` is ``batches_per_core``."""

    def __init__(self, replicas: int, per_replica: int):
        self.replicas = replicas
        self.per_replica = per_replica
        # every key present from the start: readers iterate it without the lock
        self.busy = {k: 0 for k in range(replicas)}
        self.paths: list = []       # the paths' drivers, poked when a slot frees
        self._lock = threading.Lock()
        self._next = 0              # spreads one-request batches over the cores

    def running(self) -> int:
        return sum(self.busy.values())

    def any_busy(self) -> bool:
        return any(self.busy.values())

    def free_replica(self) -> Optional[int]:
        """A replica with no batch, else one with a free slot, else None (a hint:
        :meth:`claim` decides)."""
        chosen, per, busy = None, self.per_replica, self.busy
        for replica in range(self.replicas):
            n = busy[replica]
            if not n:
                return replica
            if n < per and chosen is None:
                chosen = replica
        return chosen

    def claim(self, replica: int) -> bool:
        """Take a slot of ``replica``; False when another path took its last one."""
        with self._lock:
            if self.busy[replica] >= self.per_replica:
                return False
            self.busy[replica] += 1
            return True

    def claim_idle(self) -> Optional[int]:
        """A slot of a replica that holds no batch (round robin), or None."""
        with self._lock:
            for i in range(self.replicas):
                replica = (self._next + i) % self.replicas
                if not self.busy[replica]:
                    self.busy[replica] = 1
                    self._next = replica + 1
                    return replica
        return None

    def release(self, replica: int, path) -> None:
        """A batch of ``replica`` is answered; the other paths with requests waiting
        are poked (a slot they could not have may be free now)."""
        self.free(replica)
        self.poke_others(path)

    def free(self, replica: int) -> None:
        """A slot of ``replica`` is free again (no path is told: see release)."""
        with self._lock:
            self.busy[replica] -= 1

    def poke_others(self, path) -> None:
        """Tell the paths other than ``path`` that have requests waiting that a slot
        may be free; never with a queue's lock held (each takes its own)."""
        for other in self.paths:
            if other is not path and other.queue.waiting:
                other.poke()


class BatchQueue:
    """One path's waiting requests and the batching rules (see the module)."""

    def __init__(self, rules: Rules, slots: CoreSlots, lock=None):
        self.rules = rules
        self.slots = slots
        # reentrant: a user's signal handler that closes the server runs on the main
        # thread wherever it was, maybe in a caller holding this lock; taken only
        # with the GIL held (lock.py)
        self.lock = QueueLock() if lock is None else lock
        self.queues: List[Deque[Request]] = [
            collections.deque() for _ in range(max(1, rules.levels))]
        self.waiting = 0                               # requests in the queues
        self.rows = 0                                  # their rows
        self.counts: collections.Counter = collections.Counter()
        self.sizes: collections.Counter = collections.Counter()   # rows per batch
        self._preferred = frozenset(rules.preferred)
        self._max = rules.max_batch_size
        self._delay = rules.delay
        # callers answered by this path's last batches and not seen again: company on
        # its way (see answered); awaited until _back_by at the latest
        self.returning = 0
        self._back_by = 0.0

    # -- arrivals (the lock held) ------------------------------------------------------

    def admit(self, req: Request, policy: QueuePolicy) -> None:
        """Count a request in, or refuse it: QueueFullError at its level's bound."""
        queue = self.queues[req.level]
        if policy.max_queue_size is not None and len(queue) >= policy.max_queue_size:
            self.counts["rejected"] += 1
            raise QueueFullError(policy.max_queue_size, len(queue),
                                 req.level + 1 if self.rules.levels else None)
        self.counts["submitted"] += 1

    def add(self, req: Request) -> bool:
        """Queue an admitted request; True when its driver may act on it now: the
        first request starts the delay clock (or goes at once to an idle core), a
        full batch ends it; arrivals in between need nobody."""
        was_empty = not self.waiting
        self.queues[req.level].append(req)
        self.waiting += 1
        self.rows += req.rows
        if was_empty:
            return True
        if self._preferred:   # a preferred size may be reachable now
            return self.rows >= self.rules.preferred[0]
        return self.rows - req.rows < self._max <= self.rows   # just filled, once

    def answered(self, n: int, now: float) -> None:
        """``n`` of this path's requests are being answered at ``now``: their callers,
        threads that call in a loop as a rule, are the company a partial batch waits
        for.  Without this the thread that reads an answer (or the first caller back)
        finds the server idle and sends what is queued at once, a few rows that cost
        a whole model call, while the rest come back a moment later.  The wait lasts
        until they are back (``arrive``) or the delay from the first answer of the
        wave is out, so a caller that does not come back holds nobody past it."""
        if not self.returning or now >= self._back_by:
            self.returning = 0
            self._back_by = now + self._delay
        self.returning += n

    def arrive(self) -> bool:
        """Count an arrival against the callers awaited back; True when it was the
        last of them: a batch held for them may go now."""
        if not self.returning:
            return False
        self.returning -= 1
        return not self.returning

    def holding(self, now: float) -> float:
        """Seconds a partial batch still waits for answered callers (0: it does not)."""
        if self.returning:
            left = self._back_by - now
            if left > 0:
                return left
            self.returning = 0
        return 0.0

    def remove(self, req: Request) -> None:
        """Take a queued request out (timed out, or its loop gone)."""
        if req.queued:
            self.queues[req.level].remove(req)
            self.waiting -= 1
            self.rows -= req.rows
            req.queued = False

    def drain(self) -> List[Request]:
        """Every queued request, the queues left empty (close)."""
        waiting = [req for q in self.queues for req in q]
        for q in self.queues:
            q.clear()
        for req in waiting:
            req.queued = False
        self.waiting = self.rows = 0
        return waiting

    # -- the rules (the lock held) -----------------------------------------------------

    def due(self, free: bool) -> Tuple[int, float]:
        """(rows to take now, 0 if none; seconds until the oldest request's delay is
        out, or until the callers awaited back are given up); ``free``: the core it
        would go to runs no batch."""
        if len(self.queues) == 1:
            oldest = self.queues[0][0].arrival
        else:
            oldest = min(q[0].arrival for q in self.queues if q)
        now = time.monotonic()
        wait = oldest + self._delay - now
        if not self._preferred:
            if self.rows >= self._max:
                return self._max, wait
            hold = self.holding(now) if self.returning else 0.0
            if hold:   # answered callers are on their way back: they join this batch
                return 0, hold
            # an idle server sends at once, unless it waits for company as Triton's
            # dynamic batcher does (wait_when_idle)
            if free and (wait <= 0 or not (
                    self.rules.wait_when_idle or self.slots.any_busy())):
                return self._max, wait
            return 0, wait
        best, full = self.preferred_fit()
        if full or best == self.rules.preferred[-1]:  # cannot grow into a better one
            return best or self._max, wait
        if free and best:
            return best, wait
        hold = self.holding(now) if self.returning else 0.0
        if hold:
            return 0, hold
        if free and wait <= 0:
            return self._max, wait
        return 0, wait

    def preferred_fit(self) -> Tuple[int, bool]:
        """(the largest preferred size the queued requests reach, taken in order within
        max_batch_size, or 0; whether they fill max_batch_size or leave one out)."""
        rows = best = 0
        for queue in self.queues:
            for req in queue:
                if rows + req.rows > self._max:
                    return best, True
                rows += req.rows
                if rows in self._preferred:
                    best = rows
        return best, rows == self._max

    def direct_ok(self) -> bool:
        """Whether an arriving request may go straight to an idle core from its
        caller: only when its driver would send it at once too (nothing queued, so
        it jumps no one; no preferred sizes to wait for; no batch running anywhere,
        or no delay; no answered callers awaited back).  Then a hand-off is all a
        queue would add."""
        return not (self.waiting or self._preferred or (self._delay > 0 and (
            self.rules.wait_when_idle or self.slots.any_busy())) or (
            self.returning and self.holding(time.monotonic())))

    def take(self, limit: int, accept: Callable[[Request], bool]) -> List[Request]:
        """Pop requests up to ``limit`` rows, the highest level first and FIFO within
        a level, stopping at the first that does not fit.  A request ``accept``
        refuses is dropped: the hook is where each path marks its futures running
        and skips the cancelled and the expired (the threads' :func:`start_future`;
        an event loop's, whose futures have no running state, :func:`pending`)."""
        batch: List[Request] = []
        rows = taken = popped = 0
        arrivals = 0.0
        now = time.monotonic()
        loop_path = accept is pending   # its check inlined: this loop runs per request
        for q in self.queues:
            while q and rows + q[0].rows <= limit:
                req = q.popleft()
                popped += 1
                taken += req.rows
                req.queued = False
                if req.future.done() if loop_path else not accept(req):
                    continue
                batch.append(req)
                rows += req.rows
                arrivals += req.arrival
            if q:
                break   # its head does not fit: lower levels do not jump it
        self.waiting -= popped
        self.rows -= taken
        if batch:
            self.count_batch(batch, rows, now, arrivals)
        return batch

    def count_batch(self, batch: List[Request], rows: int, now: float,
                    arrivals: float) -> None:
        """Count a batch formed at ``now`` and its requests' time in the queue;
        ``arrivals``: their arrival times' sum."""
        counts = self.counts
        counts["queue_us"] += (now * len(batch) - arrivals) * 1e6
        counts["batches"] += 1
        counts["rows"] += rows
        self.sizes[rows] += 1


def start_future(req: Request) -> bool:
    """The threads' ``accept``: mark a thread's future running; False when its caller
    cancelled it or it already failed (timed out)."""
    try:
        return req.future.set_running_or_notify_cancel()
    except RuntimeError:   # already failed
        return False


def pending(req: Request) -> bool:
    """An event loop's ``accept``: its futures have no running state; skip those
    already done (cancelled, timed out)."""
    return not req.future.done()
