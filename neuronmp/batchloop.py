"""The BatchingServer's asyncio path: one event loop forms the batches and owns the cores.

    infer_async(x) on loop L ──▶ check ─▶ queue per priority level (the server's)
                                          │   L's timers: max_queue_delay (timerfd),
                                          │   per-request timeouts (loop.call_at)
                                          ▼
    _dispatch (on L): while a replica has a free slot and a batch is due (the server's
    own rules: batchpolicy.py): take it, stack + pad, channel.send ─────▶ nc:k
                                                                             │
    LoopChannel (Session.loop_channel): the core's readiness fd and timerfd ◀┘
      └▶ _done (on L): slot freed, each caller's rows sliced out, its asyncio
         future set; the next _dispatch runs after the callers' continuations

No lane, reader, reaper or delivery thread is on this path: everything above runs
in the loop's thread, and a request costs no hand-off between threads.  A server
serves one loop this way, the first that calls ``infer_async`` before any thread
called ``infer``/``submit`` (those start the lanes: batching.py).  Threads may
still call a server a loop serves: their requests join the same queues and the
loop is kicked (one hand-off each way, off the fast path).  A closed loop is
noticed by the supervisor or the server's next call: what it had in flight fails
with ServerClosedError, and the server serves the next loop, or threads.

Requests given as bytes (the HTTP front end's binary requests of a one-input model)
are batchbytes.py's: ``_done`` answers them through their waiters.

The other half of the asyncio bridge is :class:`Delivery`: a server its lanes
serve answers an event loop's ``infer_async`` callers through it, one
``call_soon_threadsafe`` per loop and burst.
"""
from __future__ import annotations

import asyncio
import operator
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError
from typing import Any, Dict, List, Optional, Tuple

import torch

from .batchbytes import join_rows, rows_view
from .batchpolicy import pending
from .errors import QueueFullError, RequestTimeoutError, ServerClosedError
from .pool.loopchannel import LoopAnswer, Timer
from .session import chunking

__all__ = ["Delivery", "LoopScheduler"]

_now_ns = time.perf_counter_ns
# per-request fields read in C (map), not a generator step per request
_rows_of, _raw_of = operator.attrgetter("rows"), operator.attrgetter("raw")


class LoopScheduler:
    """The batching of one BatchingServer on one event loop (see the module)."""

    def __init__(self, server, loop: asyncio.AbstractEventLoop):
        self.server = server
        self.loop = loop
        self.thread = threading.get_ident()
        self._channels: Dict[int, Any] = {}     # global core -> LoopChannel (or None)
        self._running: Dict[int, list] = {}     # id(answer) -> its batch
        self._delay = Timer(loop, self._dispatch)   # a partial batch's due time
        self._dispatch_pending = False
        self._arrival = False
        self._idle = threading.Event()           # nothing running (for close)
        self._idle.set()
        self._gone = False

    # -- requests -----------------------------------------------------------------

    def submit(self, req, policy, on_loop: bool = False) -> None:
        """Queue ``req`` (its future an asyncio future of this loop, or a thread's
        Answer); raises at once for a full queue or a closed server.  On any thread
        (``on_loop``: the caller knows it is this loop's)."""
        server = self.server
        queue = server._queues[req.level]
        with server._lock:
            if server._closed:
                raise ServerClosedError("the BatchingServer is closed; no new requests")
            if policy.max_queue_size is not None and len(queue) >= policy.max_queue_size:
                server._counts["rejected"] += 1
                raise QueueFullError(policy.max_queue_size, len(queue),
                                     req.level + 1 if server.priority_levels else None)
            server._counts["submitted"] += 1
            queue.append(req)
            server._waiting += 1
            server._rows += req.rows
        if on_loop or threading.get_ident() == self.thread:
            if req.deadline is not None:
                self._track(req)
            if not self._dispatch_pending:
                self._dispatch_soon(arrival=True)
        else:
            try:
                self.loop.call_soon_threadsafe(self._arrived, req)
            except RuntimeError:   # the loop closed meanwhile
                self._lost_request(req)

    def _arrived(self, req) -> None:
        if req.deadline is not None:
            self._track(req)
        self._dispatch_soon(arrival=True)

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

    def _track(self, req) -> None:
        req.timer = self.loop.call_at(req.deadline, self._expire, req)

    def _expire(self, req) -> None:
        server = self.server
        if req.future.done():
            return
        with server._lock:
            stage = "waiting in the queue" if req.queued else "running"
            if req.queued:
                server._queues[req.level].remove(req)
                server._waiting -= 1
                server._rows -= req.rows
                req.queued = False
            server._counts["timed_out"] += 1
        _reject(req.future, RequestTimeoutError(req.timeout, stage))

    # -- batches ------------------------------------------------------------------

    def _dispatch(self, arrival: bool = False) -> None:
        """Send every batch that is due to a core with a free slot (on the loop);
        ``arrival``: a request just came (to an idle server, it goes "direct")."""
        self._dispatch_pending = False
        server = self.server
        sends = []
        with server._lock:
            if server._closed:
                return
            busy, per_replica = server._busy, server._per_replica
            while server._waiting:
                replica = self._free_replica(busy, per_replica)
                if replica is None:
                    break
                free = not busy.get(replica)
                limit, wait = server._due(free)
                if not limit:
                    if free:
                        self._delay.at(_now_ns() + max(0, int(wait * 1e9)))
                    break
                batch = server._take(limit, pending)
                if not batch:
                    continue
                busy[replica] = busy.get(replica, 0) + 1
                sends.append((batch, replica))
        direct = arrival and len(sends) == 1 and len(sends[0][0]) == 1
        for batch, replica in sends:
            self._send(batch, replica, direct)

    def _free_replica(self, busy: dict, per_replica: int) -> Optional[int]:
        """A replica with no batch, else one with a free slot, else None."""
        chosen = None
        for replica in range(self.server._replicas):
            n = busy.get(replica, 0)
            if not n:
                return replica
            if n < per_replica and chosen is None:
                chosen = replica
        return chosen

    def _send(self, batch: list, replica: int, direct: bool) -> None:
        server = self.server
        rows = sum(map(_rows_of, batch))
        if server._model.buckets:   # one piece: the server never takes past the largest
            total = server._model.bucket_for(rows)
            count = 1
        else:
            pad, _ = chunking.plan(rows, server.batch_size, 1)
            total = rows + pad
            count = total // server.batch_size
        pad = total - rows
        into = batch[0].into if len(batch) == 1 and not pad else None
        t0 = time.monotonic()
        answer = LoopAnswer(self.loop, self.thread,
                            lambda ok, value, on_loop: self._done(
                                batch, replica, t0, total, ok, value, on_loop, key), into)
        key = id(answer)
        self._running[key] = batch
        self._idle.clear()
        if direct:
            with server._lock:
                server._counts["direct"] += 1
        try:
            args = join_rows(batch, total, pad) if any(map(_raw_of, batch)) else None
            if args is None:
                args = [server._assemble(batch, i, pad) for i in range(len(server._signature))]
            session, core, mid = server._model.target(replica)
            payload = (count, *args)
            channel = self._channel(session, core)
            if channel is not None:
                channel.send(mid, payload, answer)
            else:   # another running loop owns the core: the pool's own path
                sent = session.call(core, mid, payload, into)
                sent.add_done_callback(lambda a: _forward(a, answer))
        except BaseException as exc:  # noqa: BLE001 - every caller must hear of it
            answer.set_exception(exc)
            if not isinstance(exc, Exception):
                raise

    def _channel(self, session, core: int):
        held = self._channels.get(core)
        channel = session.loop_channel(core, self.loop, held)
        if channel is held and held is not None:
            return channel
        if held is not None:
            held.users -= 1
        if channel is not None:
            channel.users += 1
            channel.watchers.append(self._channel_orphaned)
        self._channels[core] = channel
        return channel

    def _done(self, batch: list, replica: int, t0: float, total: int, ok: bool,
              value: Any, on_loop: bool, key: int) -> None:
        """A batch's answer (on the loop; ``on_loop`` False: the loop is closed and
        this runs in the thread that read it)."""
        server = self.server
        self._running.pop(key, None)
        with server._lock:
            server._counts["compute_us"] += (time.monotonic() - t0) * 1e6
            server._busy[replica] -= 1
        if not self._running:
            self._idle.set()
        if not on_loop:
            self._fail(batch, ServerClosedError(
                "the event loop that sent this request was closed before its answer came"),
                loop_alive=False)
            return
        if ok:
            try:
                self._answer(batch, value, total)
            except BaseException as exc:  # noqa: BLE001 - e.g. an output of the wrong shape
                self._fail(batch, exc)
        else:
            self._fail(batch, value)
        if server._closed:
            if not self._running:
                self._detach()
        elif server._waiting:
            self._dispatch_soon()   # after the callers', which may queue their next requests

    def _answer(self, batch: list, outs: List[Any], total: int) -> None:
        server = self.server
        if batch[0].raw is not None and len(outs) == 1 and server._single_output == 0 and \
                all(r.raw is not None for r in batch):
            view = rows_view(outs[0], total)
            if view is not None:
                self._answer_rows(batch, outs[0], view)
                return
        values = server._values(batch, outs, total)
        done = 0
        for req, value in zip(batch, values):
            if req.timer is not None:
                req.timer.cancel()
            fut = req.future
            if not fut.done():
                try:
                    fut.set_result(value)
                    done += 1
                except InvalidStateError:   # a thread's request, cancelled just now
                    pass
        with server._lock:
            server._counts["completed"] += done

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
        with self.server._lock:
            self.server._counts["completed"] += done

    def _fail(self, batch: list, exc: BaseException, loop_alive: bool = True) -> None:
        server = self.server
        with server._lock:
            server._counts["failed"] += len(batch)
        for req in batch:
            if loop_alive and req.timer is not None:
                req.timer.cancel()
            if loop_alive or isinstance(req.future, Future):
                _reject(req.future, server._copy_error(exc))

    def _lost_request(self, req) -> None:
        """A thread's request for a loop that closed before it could take it."""
        server = self.server
        with server._lock:
            if req.queued:
                server._queues[req.level].remove(req)
                server._waiting -= 1
                server._rows -= req.rows
                req.queued = False
        _reject(req.future, ServerClosedError(
            "the event loop serving this BatchingServer is closed"))

    # -- life -----------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        return not self._gone and not self.loop.is_closed()

    def close(self, waiting: list, timeout: float) -> None:
        """The server closed (its queues already emptied into ``waiting``): fail those,
        let running batches finish (waiting up to ``timeout`` s unless this is the
        loop's thread, which must go on reading them), then let the cores go."""
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
            self._idle.wait(timeout)
        if not alive or self.loop.is_closed():
            self.orphan()
        stuck = ServerClosedError(
            f"the BatchingServer was closed while this request still ran after {timeout:g} s")
        for batch in list(self._running.values()):
            for req in batch:
                self._reject_any(req.future, stuck, on_loop,
                                 alive and not self.loop.is_closed())

    def _close_on_loop(self) -> None:
        if not self._running:
            self._detach()

    def _reject_any(self, fut, err, on_loop: bool, alive: bool) -> None:
        if isinstance(fut, Future):
            _reject(fut, self.server._copy_error(err))
        elif on_loop:
            _reject(fut, self.server._copy_error(err))
        elif alive:
            try:
                self.loop.call_soon_threadsafe(_reject, fut, self.server._copy_error(err))
            except RuntimeError:
                pass

    def _detach(self) -> None:
        """On the loop: release the cores this server used (nothing running)."""
        self._gone = True
        self._delay.close()
        for channel in self._channels.values():
            if channel is None:
                continue
            channel.users -= 1
            if channel.users <= 0 and channel.idle:
                channel.detach()
        self._channels.clear()

    def _channel_orphaned(self) -> None:
        """A channel of ours was orphaned (the supervisor saw the loop closed)."""
        if self.loop.is_closed():
            self.orphan()

    def orphan(self) -> None:
        """The loop is closed: give the cores back, fail the threads' requests it had
        queued (and unbind the server); what the cores still hold for us fails when
        it is read (LoopAnswer's callback, off the loop).  Any thread."""
        server = self.server
        with server._lock:
            if server._sched is self:
                server._sched = None
            if self._gone and not self._channels:
                return
            self._gone = True
            channels, self._channels = list(self._channels.values()), {}
        self._delay.close(loop_alive=False)
        for channel in channels:
            if channel is not None:
                channel.orphan()
        with server._lock:   # queued requests of the closed loop: nobody takes them now
            waiting = [r for q in server._queues for r in q]
            for q in server._queues:
                q.clear()
            server._waiting = 0
            server._rows = 0
        err = ServerClosedError("the event loop serving this BatchingServer is closed")
        for req in waiting:
            if isinstance(req.future, Future):
                _reject(req.future, err)


def _reject(fut, exc: BaseException) -> None:
    try:
        if not fut.done():
            fut.set_exception(exc)
    except (InvalidStateError, asyncio.InvalidStateError, RuntimeError):
        pass


def _forward(sent, answer: LoopAnswer) -> None:
    exc = sent.exception()
    if exc is None:
        answer.set_result(sent.result())
    else:
        answer.set_exception(exc)


class Delivery:
    """Answers for one event loop's ``infer_async`` callers, handed over in bulk.

    An answer settled in another thread (a lane, a core's reader, the timeout
    reaper) is put on a list; only the first on an empty list wakes the loop
    (``call_soon_threadsafe``), and the loop then sets the asyncio futures of all
    that arrived meanwhile.  A lane answering a batch of n requests wakes the loop
    once, not n times (``asyncio.wrap_future`` schedules a call per future).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)   # the server outlives the loops of its callers
        self._lock = threading.Lock()
        self._ready: List[Tuple[Future, asyncio.Future]] = []

    def add(self, answer: Future, waiter: asyncio.Future) -> None:
        """Set ``waiter`` (a future of this loop) from ``answer`` once it is done."""
        answer.add_done_callback(lambda a: self._settled(a, waiter))

    def _settled(self, answer: Future, waiter: asyncio.Future) -> None:
        with self._lock:
            first = not self._ready
            self._ready.append((answer, waiter))
        loop = self._loop()
        if first and loop is not None:
            try:
                loop.call_soon_threadsafe(self._flush)
            except RuntimeError:   # the loop is closed: nobody awaits these any more
                pass

    def _flush(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
        for answer, waiter in ready:
            if waiter.done():      # its caller was cancelled meanwhile
                continue
            if answer.cancelled():
                waiter.cancel()
            elif answer.exception() is not None:
                waiter.set_exception(answer.exception())
            else:
                waiter.set_result(answer.result())

