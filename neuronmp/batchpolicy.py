"""The BatchingServer's scheduling policy: which requests make the next batch, and when.

    submit ─▶ _queue: one FIFO per priority level ──▶ _due(free): (rows to take, wait)
              wakes a lane only when one can act        full batch: now; a free core:
              (first arrival, a batch just filled,      once the oldest waited the
              a preferred size reached)                 delay, or at once if nothing
                                                        runs (unless wait_when_idle);
                                                        preferred sizes first
              _take(limit, accept) ◀───────────────────┘
                level 1 first, FIFO within a level, stops at the first that does
                not fit; ``accept`` settles each path's futures its own way
    _direct_replica: an idle server's request skips the queue (sent by its caller)

Pure logic over the server's queues and counters (a mixin of BatchingServer, every
method called with the server's lock held): no threads, no waiting, no I/O.  The
threads that act on it are batchlanes.py's, or one event loop's (batchloop.py).
"""
from __future__ import annotations

import time
from typing import Callable, Deque, List, Optional, Tuple

__all__ = ["Policy", "Request", "pending", "start_future"]


class Request:
    """One caller's inputs (one sample each if ``single``, else rows), its future,
    its clock and its queue (``level``: 0 is the highest priority)."""

    __slots__ = ("inputs", "rows", "single", "future", "arrival", "deadline", "timeout",
                 "queued", "level", "sender", "timer", "into", "raw")

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
        self.sender = 0  # the thread sending it straight to a core, while it does
        self.timer = None  # its deadline's handle on the event loop path
        self.into = None   # its Destination, on the event loop path
        self.raw = None    # its RowInput when ``inputs`` is one input's bytes (batchbytes.py)


class Policy:
    """The scheduling half of a BatchingServer (see the module docstring)."""

    def _queue(self, req: Request, queue: Deque[Request]) -> None:
        """Append a request for the lanes and wake those that may act on it (lock held)."""
        was_empty = not self._waiting
        queue.append(req)
        self._waiting += 1
        self._rows += req.rows
        # the first request starts the delay clock (or goes at once to an idle
        # core), a full batch ends it; arrivals in between need nobody awake
        if was_empty:  # a lane of a free core goes at once, or starts the delay clock
            self._wake()
        elif self._preferred:   # a preferred size may be reachable now
            if self._rows >= self.preferred_batch_size[0]:
                self._wake()
        elif self._rows - req.rows < self.max_batch_size <= self._rows:
            self._wake()  # a batch just filled up (once, not per arrival)

    def _due(self, free: bool) -> Tuple[int, float]:
        """(rows to take now, 0 if none; seconds until the oldest request's delay is
        out), the lock held; ``free``: this lane's core runs no batch."""
        if len(self._queues) == 1:
            oldest = self._queues[0][0].arrival
        else:
            oldest = min(q[0].arrival for q in self._queues if q)
        wait = oldest + self._delay - time.monotonic()
        if not self._preferred:
            # an idle server sends at once, unless it waits for company as Triton's
            # dynamic batcher does (wait_when_idle)
            if self._rows >= self.max_batch_size or (free and (wait <= 0 or not (
                    self.wait_when_idle or any(self._busy.values())))):
                return self.max_batch_size, wait
            return 0, wait
        best, full = self._preferred_fit()
        if full or best == self.preferred_batch_size[-1]:  # cannot grow into a better one
            return best or self.max_batch_size, wait
        if free and (best or wait <= 0):
            return best or self.max_batch_size, wait
        return 0, wait

    def _preferred_fit(self) -> Tuple[int, bool]:
        """(the largest preferred size the queued requests reach, taken in order within
        max_batch_size, or 0; whether they fill max_batch_size or leave a request
        out), the lock held."""
        rows = best = 0
        for queue in self._queues:
            for req in queue:
                if rows + req.rows > self.max_batch_size:
                    return best, True
                rows += req.rows
                if rows in self._preferred:
                    best = rows
        return best, rows == self.max_batch_size

    def _take(self, limit: int, accept: Callable[[Request], bool]) -> List[Request]:
        """Pop requests up to ``limit`` rows, the highest priority level first and FIFO
        within a level, stopping at the first that does not fit (the lock held).  A
        request ``accept`` refuses is dropped: the hook is where each path marks its
        futures running and skips the cancelled and the expired (the lanes'
        :func:`start_future`; the event loop's, whose futures have no running state,
        :func:`pending`)."""
        batch: List[Request] = []
        rows = taken = popped = 0
        arrivals = 0.0
        now = time.monotonic()
        loop_path = accept is pending   # its check inlined: this loop runs per request
        for q in self._queues:
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
        self._waiting -= popped
        self._rows -= taken
        if batch:
            self._count_batch(batch, rows, now, arrivals)
        return batch

    def _count_batch(self, batch: List[Request], rows: int, now: float,
                     arrivals: float) -> None:
        """Count a batch formed at ``now`` and its requests' time in the queue (lock
        held); ``arrivals``: their arrival times' sum."""
        self._counts["queue_us"] += (now * len(batch) - arrivals) * 1e6
        self._counts["batches"] += 1
        self._counts["rows"] += rows
        self._sizes[rows] += 1

    def _direct_replica(self) -> Optional[int]:
        """A core for a request to go to straight from its caller, or None (lock held).

        Only when a lane would send it at once too: nothing queued (so it jumps no
        one), no preferred sizes to wait for, and no batch running anywhere (an idle
        server that does not wait for company; with no delay, any core without a
        batch).  Then the lanes' hand-off
        (waking a lane, which then waits for the core) is all the request would gain
        from them, and on a small request it was the largest cost.
        """
        if self._waiting or self._preferred or (self._delay > 0 and (
                self.wait_when_idle or any(self._busy.values()))):
            return None
        for i in range(self._replicas):
            replica = (self._next_direct + i) % self._replicas
            if not self._busy.get(replica):
                self._next_direct = replica + 1
                return replica
        return None


def start_future(req: Request) -> bool:
    """The lanes' ``accept``: mark a thread's future running; False when its caller
    cancelled it or it already failed (timed out)."""
    try:
        return req.future.set_running_or_notify_cancel()
    except RuntimeError:   # already failed
        return False


def pending(req: Request) -> bool:
    """The event loop's ``accept``: its futures (asyncio's, or a thread's Answer)
    have no running state; skip those already done (cancelled, timed out)."""
    return not req.future.done()
