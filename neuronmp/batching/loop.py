"""An event loop's path: its ``infer_async`` callers' batches, formed on the loop itself.

    infer_async(x) on loop L ──▶ check ─▶ L's BatchQueue (queue.py)
                                          │   L's timers: max_queue_delay (timerfd),
                                          │   per-request timeouts (loop.call_at)
                                          ▼
    _dispatch (on L): while a replica has a free slot (CoreSlots, shared with the
    server's other paths) and a batch is due: take it, stack + pad, Route.send ─▶ nc:k
                                                                                   │
    the route's channel (L owns the core's rings: its readiness fd, a timerfd) ◀──┘
      └▶ _done (on L): slot freed, each caller's rows sliced out, its asyncio
         future set; the next _dispatch runs after the callers' continuations

One LoopDriver per loop that calls the server, made by its first call there, so
several loops each batch their own callers, and threads meanwhile take theirs
(threads.py).  No serving, reader or timer thread is on this path: all
of it runs in the loop's thread, and a request costs no hand-off between threads.
A core another running loop owns takes the pool's call (the route hands its
answer to this loop).  A closed loop is noticed by the supervisor or the server's
next call: what it had in flight fails with ServerClosedError.

Requests given as bytes (the HTTP front end's binary requests of a one-input model)
are rowbytes.py's: ``_done`` answers them through their waiters.
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import InvalidStateError
from typing import Any, Dict, List

import torch

from ..errors import RequestTimeoutError, ServerClosedError
from ..session.model import Route
from .queue import BatchQueue, CoreSlots, pending
from .rowbytes import rows_view
from .threads import copy_error

__all__ = ["LoopDriver"]

_now_ns = time.perf_counter_ns


class LoopDriver:
    """The batching of one BatchingServer's callers on one event loop (see the module)."""

    name = "event_loop"

    def __init__(self, rows, rules, slots: CoreSlots, model, loop: asyncio.AbstractEventLoop,
                 on_gone):
        self.rows = rows
        self.loop = loop
        self.thread = threading.get_ident()
        # only this loop's thread queues and takes; the lock is for stats and close
        self.queue = BatchQueue(rules, slots, threading.Lock())
        self.slots = slots
        self._route = Route(model, loop, self.orphan)
        self._running: Dict[int, list] = {}     # key -> its batch
        self._keys = 0
        self._delay = self._route.timer(self._dispatch)   # a partial batch's due time
        self._dispatch_pending = False
        self._arrival = False
        self._idle = threading.Event()           # nothing running (for close)
        self._idle.set()
        self._gone = False
        self._on_gone = on_gone                  # the server forgets this driver
        self.closed = False

    # -- requests -----------------------------------------------------------------

    def submit(self, req, policy) -> None:
        """Queue ``req`` (its future one of this loop's, or a RowsWaiter), on the
        loop's thread; raises at once for a full queue or a closed server."""
        queue = self.queue
        with queue.lock:
            if self.closed:
                raise ServerClosedError("the BatchingServer is closed; no new requests")
            queue.admit(req, policy)
            queue.add(req)
        if req.deadline is not None:
            req.timer = self.loop.call_at(req.deadline, self._expire, req)
        if not self._dispatch_pending:
            self._dispatch_soon(arrival=True)

    def poke(self) -> None:
        """A slot another path held is free (any thread): look at the queue again."""
        if threading.get_ident() == self.thread:
            self._dispatch_soon()
            return
        try:
            self.loop.call_soon_threadsafe(self._dispatch_soon)
        except RuntimeError:   # the loop is closed
            pass

    def _dispatch_soon(self, arrival: bool = False) -> None:
        """Form batches once the callbacks ready now have run: the callers answered
        by one batch send their next requests in one pass of the loop, and they
        go together rather than the first few alone."""
        if not self._dispatch_pending:
            self._dispatch_pending = True
            self._arrival = arrival and not self._running
            self.loop.call_soon(self._dispatch_queued)

    def _dispatch_queued(self) -> None:
        self._dispatch(self._arrival)

    def _expire(self, req) -> None:
        if req.future.done():
            return
        queue = self.queue
        with queue.lock:
            stage = "waiting in the queue" if req.queued else "running"
            queue.remove(req)
            queue.counts["timed_out"] += 1
        _reject(req.future, RequestTimeoutError(req.timeout, stage))

    # -- batches ------------------------------------------------------------------

    def _dispatch(self, arrival: bool = False) -> None:
        """Send every batch that is due to a core with a free slot (on the loop);
        ``arrival``: a request just came (to an idle server, it goes "direct")."""
        self._dispatch_pending = False
        queue, slots = self.queue, self.slots
        sends = []
        with queue.lock:
            if self.closed:
                return
            while queue.waiting:
                replica = slots.free_replica()
                if replica is None:
                    break
                free = not slots.busy[replica]
                limit, wait = queue.due(free)
                if not limit:
                    if free:
                        self._delay.at(_now_ns() + max(0, int(wait * 1e9)))
                    break
                if not slots.claim(replica):
                    continue
                batch = queue.take(limit, pending)
                if not batch:
                    sends.append(((), replica))
                    continue
                sends.append((batch, replica))
            if arrival and len(sends) == 1 and len(sends[0][0]) == 1:
                queue.counts["direct"] += 1
        for batch, replica in sends:
            if batch:
                self._send(batch, replica)
            else:
                slots.release(replica, self)

    def _send(self, batch: list, replica: int) -> None:
        t0 = time.monotonic()
        key = self._keys = self._keys + 1
        self._running[key] = batch
        self._idle.clear()
        total = 0
        try:
            args, total, count, into = self.rows.payload(batch)
            self._route.send(args, count, replica, lambda ok, value, on_loop: self._done(
                batch, replica, t0, total, ok, value, on_loop, key), into)
        except BaseException as exc:  # noqa: BLE001 - every caller must hear of it
            self._done(batch, replica, t0, total, False, exc, True, key)
            if not isinstance(exc, Exception):
                raise

    def _done(self, batch: list, replica: int, t0: float, total: int, ok: bool,
              value: Any, on_loop: bool, key: int) -> None:
        """A batch's answer (on the loop; ``on_loop`` False: the loop is closed and
        this runs in the thread that read it)."""
        queue = self.queue
        self._running.pop(key, None)
        with queue.lock:
            queue.counts["compute_us"] += (time.monotonic() - t0) * 1e6
        self.slots.release(replica, self)
        if not on_loop:
            self._fail(batch, ServerClosedError(
                "the event loop that sent this request was closed before its answer came"),
                loop_alive=False)
        elif ok:
            try:
                self._answer(batch, value, total)
            except BaseException as exc:  # noqa: BLE001 - e.g. an output of the wrong shape
                self._fail(batch, exc)
        else:
            self._fail(batch, value)
        if not self._running:   # idle once its callers are settled: close() waits for it
            self._idle.set()
        if not on_loop:
            return
        if self.closed:
            if not self._running:
                self._detach()
        elif queue.waiting:
            self._dispatch_soon()   # after the callers', which may queue their next requests

    def _answer(self, batch: list, outs: List[Any], total: int) -> None:
        rows = self.rows
        if batch[0].raw is not None and len(outs) == 1 and rows.single_output == 0 and \
                all(r.raw is not None for r in batch):
            view = rows_view(outs[0], total)
            if view is not None:
                self._answer_rows(batch, outs[0], view)
                return
        values = rows.values(batch, outs, total)
        done = 0
        for req, value in zip(batch, values):
            if req.timer is not None:
                req.timer.cancel()
            fut = req.future
            if not fut.done():
                fut.set_result(value)
                done += 1
        with self.queue.lock:
            self.queue.counts["completed"] += done

    def _answer_rows(self, batch: list, out: torch.Tensor, view: memoryview) -> None:
        """Each RowsWaiter its rows' bytes of the one output, sliced from one view of
        the batch's output (no tensor per request)."""
        per = len(view) // out.shape[0]
        start = done = 0
        for req in batch:
            if req.timer is not None:
                req.timer.cancel()
            rows, waiter = req.rows, req.future
            if not waiter.done():
                waiter.set_rows(view[start * per:(start + rows) * per], out, start, rows)
                done += 1
            start += rows
        with self.queue.lock:
            self.queue.counts["completed"] += done

    def _fail(self, batch: list, exc: BaseException, loop_alive: bool = True) -> None:
        with self.queue.lock:
            self.queue.counts["failed"] += len(batch)
        if not loop_alive:
            return   # its futures belong to a closed loop: nobody awaits them
        for req in batch:
            if req.timer is not None:
                req.timer.cancel()
            _reject(req.future, copy_error(exc))

    # -- life -----------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        return not self._gone and not self.loop.is_closed()

    def close(self, deadline: float, stuck: BaseException) -> None:
        """The server closed: fail what waits, let running batches finish (waiting
        until ``deadline`` unless this is the loop's thread, which must go on reading
        them), fail those still running with ``stuck``, then let the cores go."""
        with self.queue.lock:
            if self.closed:
                return
            self.closed = True
            waiting = self.queue.drain()
        err = ServerClosedError("the BatchingServer was closed before this request ran")
        on_loop = threading.get_ident() == self.thread
        alive = not self.loop.is_closed()
        for req in waiting:
            self._reject_any(req.future, err, on_loop, alive)
        if on_loop:
            if not self._running:
                self._detach()
            return
        if alive:
            try:
                self.loop.call_soon_threadsafe(self._close_on_loop)
            except RuntimeError:
                alive = False
        if alive:
            self._idle.wait(max(0.0, deadline - time.monotonic()))
        if not alive or self.loop.is_closed():
            self.orphan()
        for batch in list(self._running.values()):
            for req in batch:
                self._reject_any(req.future, stuck, on_loop,
                                 alive and not self.loop.is_closed())

    def _close_on_loop(self) -> None:
        if not self._running:
            self._detach()

    def _reject_any(self, fut, err, on_loop: bool, alive: bool) -> None:
        if on_loop:
            _reject(fut, copy_error(err))
        elif alive:
            try:
                self.loop.call_soon_threadsafe(_reject, fut, copy_error(err))
            except RuntimeError:
                pass

    def _detach(self) -> None:
        """On the loop: release the cores this path used (nothing running)."""
        self._gone = True
        self._delay.close()
        self._route.release()
        self._on_gone(self)

    def orphan(self) -> None:
        """The loop is closed (any thread): give the cores back, drop what it had
        queued (nobody awaits a closed loop's futures); what the cores still hold for
        it fails when it is read (off the loop)."""
        with self.queue.lock:
            if self._gone and not self._route.owns():
                return
            self._gone = True
            self.queue.drain()
        self._delay.close(loop_alive=False)
        self._route.orphan()
        self._on_gone(self)


def _reject(fut, exc: BaseException) -> None:
    try:
        if not fut.done():
            fut.set_exception(exc)
    except (InvalidStateError, asyncio.InvalidStateError, RuntimeError):
        pass
