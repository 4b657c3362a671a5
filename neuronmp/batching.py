"""Serving: a dynamic-batching request server over a traced model's cores.

    callers (threads / asyncio)          BatchingServer                      pool workers
    submit(x) ─▶ check shape/dtype ─┬─ idle server (nothing queued or running, no
                                    │  preferred sizes): take a core's slot, send a
                                    │  one-request batch from the caller's thread ─▶ nc:k
                                    │  (answered by whichever thread reads the core's
                                    │  answer, usually its reader; see below)
                                    └▶ queue per priority level ┐
    submit(x) ─▶ ...                  (FIFO, bounded)          │ lane k (one thread per
    ...                                 ▲ reaper: timeouts     │ core x batches_per_core):
                                                               │  take rows <= max_batch_size,
                                                               │  level 1 first, once full; or,
                                                               │  its core free, at a preferred
                                                               │  size, once the oldest has
                                                               │  waited max_queue_delay_ms, or
                                                               │  at once if no batch is running
                                                               │  (and no preferred sizes)
                                                               ▼
          stack + zero-pad to whole traced batches ─ model.submit(replica=k) ─▶ nc:k
    Answer.settle ◀── slice each request's rows out of the outputs ◀─────────────────────┘
        └▶ asyncio callers: one call_soon_threadsafe per loop and burst (_Delivery)

Each lane owns one batch slot of one of the model's cores (a replica index) and
waits for its own answer (the synchronous path, no hand-off between threads),
so with ``batches_per_core=2`` the
next batch of a core is formed and queued while the current one runs, and every
core stays busy whenever there is work.  A worker that dies fails the requests of
the batches it held with :class:`~neuronmp.errors.WorkerDiedError` (they are not
retried: a model call is not assumed idempotent); the pool restarts the worker and
the lane carries on with the next batch, while the other cores keep serving.

A request that arrives while the server is idle does not wake a lane: its caller
sends it (the lanes' hand-off was most of a small request's cost), and the core's
answer is read by the pool's reader thread, which answers it.  Its slot of the
core is taken under the lanes' lock and counted with theirs, so a lane waits while
its core holds ``batches_per_core`` batches, whoever sent them.  Such a request,
when it is exactly one traced batch of rows, may name buffers for its outputs
(``into``, a :class:`~neuronmp.model.Destination`): the core's answer is
then copied out of the response ring straight into them.  Batched requests get
their rows of the batch's outputs, fresh tensors, whatever they name.

All of the above is the threads' path.  A server whose first caller is an event
loop (``infer_async``) is served by that loop instead, with no thread of the
server's: the loop forms the batches on its own timers and owns the cores' rings
(see :mod:`neuronmp.batchloop`, and docs/guides/event-loop-serving.md).  The lanes
start with the first request from a thread, and a server they serve answers event
loop callers as before (one ``call_soon_threadsafe`` per loop and burst).

The number of lanes is fixed when the server starts (place the model first:
``set_multicore``, ``set_neuron_cores``); which core a replica index means is
asked of the model at every batch, so the server follows a model that is moved
later, or loaded again after a runtime restart.
"""
from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Deque, List, Mapping, Optional, Sequence, Tuple

import torch

from . import chunking, pytree
from . import model as _model
from . import runtime as _runtime
from .batchloop import LoopScheduler
from .errors import (
    NeuronmpError,
    QueueFullError,
    RequestTimeoutError,
    ServerClosedError,
)
from .model import Answer, Destination, wake_answers

__all__ = ["BatchingServer", "QueuePolicy", "QueueFullError", "RequestTimeoutError",
           "ServerClosedError"]

_DEFAULT: Any = object()   # "use the server's timeout"
_CLOSE_GRACE = 10.0


@dataclass(frozen=True)
class QueuePolicy:
    """The queue policy of one priority level (Triton's ``ModelQueuePolicy``).

    ``max_queue_size``: requests that may wait at this level (None: no bound; a request
    beyond it is refused with QueueFullError at once).  ``timeout``: the level's default
    per-request deadline in seconds (None: none; RequestTimeoutError past it).
    """

    max_queue_size: Optional[int] = None
    timeout: Optional[float] = None


class _Request:
    """One caller's inputs (one sample each if ``single``, else rows), its future,
    its clock and its queue (``level``: 0 is the highest priority)."""

    __slots__ = ("inputs", "rows", "single", "future", "arrival", "deadline", "timeout",
                 "queued", "level", "sender", "timer", "into")

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


class BatchingServer:
    """Combine concurrent requests into batches and run them on a traced model's cores.

    ``model`` is a module made by :func:`neuronmp.trace` at the batch size the server
    should run (its traced batch ``b``), placed on one or more cores.  Requests are
    single samples (inputs without the batch dimension; the result has none either) or
    small batches (``k`` rows, ``1 <= k <= max_batch_size``).  Up to ``max_batch_size``
    rows (default ``b``) are combined, zero-padded to a whole number of traced batches
    and run; each caller gets its own rows of the outputs, in the traced output
    structure.  A full batch goes at once.  A partial one waits for more requests at
    most ``max_queue_delay_ms`` after its oldest arrived while a core is free to run it;
    while every core is busy, requests wait for a core and keep joining the next batch
    (the rule of Triton's dynamic batcher: the delay bounds the wait for company, not
    the wait for a core).

        model = neuronmp.trace(net, torch.rand(16, 512))
        neuronmp.set_multicore(model)
        with neuronmp.batching.BatchingServer(model, 16, max_queue_delay_ms=2) as server:
            y = server.infer(torch.rand(512))                 # blocking, from any thread
            fut = server.submit(torch.rand(3, 512))           # concurrent.futures.Future
            y = await server.infer_async(torch.rand(512))     # asyncio

    ``preferred_batch_size`` (row counts <= max_batch_size) are the batches to form
    when they can be, as Triton's dynamic batcher forms them: when the queued requests,
    taken in order, add up to a preferred size, a batch of the largest such size goes at
    once; else the batch waits up to ``max_queue_delay_ms`` for one (even on an idle
    server), then takes what is queued, up to ``max_batch_size``.

    ``priority_levels`` (Triton's schedule policy): with ``N > 0`` levels every level has
    a queue of its own, level 1 the highest; a batch is filled from level 1's queue
    first, then level 2's, ..., in arrival order within a level.  ``submit(...,
    priority=k)`` picks the level (None or 0: ``default_priority_level``, which defaults
    to the lowest, N).  With no levels there is one queue.

    ``max_queue_size`` bounds the waiting requests of each level (QueueFullError beyond
    it); ``timeout`` (seconds) is the default per-request deadline, counted from
    submission (RequestTimeoutError; a batch already running is not interrupted, its late
    answer is dropped).  ``priority_queue_policy`` ({level: QueuePolicy}) replaces both
    for the levels it names.  ``batches_per_core`` is how many batches each core may
    hold: 2 lets the next batch be formed and shipped while the current one runs.
    ``close()`` (or leaving the ``with`` block) fails the waiting requests with
    ServerClosedError, lets running batches finish, and stops every thread the server
    started.
    """

    def __init__(self, model: torch.nn.Module, max_batch_size: Optional[int] = None,
                 max_queue_delay_ms: float = 1.0, *, max_queue_size: Optional[int] = None,
                 timeout: Optional[float] = None, batches_per_core: int = 2,
                 warmup: bool = True, preferred_batch_size: Sequence[int] = (),
                 priority_levels: int = 0, default_priority_level: Optional[int] = None,
                 priority_queue_policy: Optional[Mapping[int, QueuePolicy]] = None):
        if not _model.is_traced(model):
            raise TypeError(
                "BatchingServer expects a model made by neuronmp.trace, got "
                f"{type(model).__name__}"
            )
        self._model = _model.model_of(model)
        buckets = self._model.buckets   # then the model pads each batch to its bucket
        self.batch_size: int = 1 if buckets else _traced_batch(self._model)
        self.max_batch_size: int = _check_int("max_batch_size", max_batch_size, 1,
                                              default=buckets[-1] if buckets else self.batch_size)
        if buckets and self.max_batch_size > buckets[-1]:
            # a batch runs in one graph: the event loop sends it whole, as one bucket
            raise ValueError(f"max_batch_size={self.max_batch_size} is larger than the model's "
                             f"largest batch bucket ({buckets[-1]}): accepted 1 to {buckets[-1]}")
        self.max_queue_delay_ms: float = _check_number("max_queue_delay_ms",
                                                       max_queue_delay_ms, allow_zero=True)
        self.max_queue_size: Optional[int] = (
            None if max_queue_size is None else _check_int("max_queue_size", max_queue_size, 1))
        self.timeout: Optional[float] = (
            None if timeout is None else _check_number("timeout", timeout))
        batches_per_core = _check_int("batches_per_core", batches_per_core, 1)
        self.preferred_batch_size: Tuple[int, ...] = _check_preferred(
            preferred_batch_size, self.max_batch_size)
        self._preferred = frozenset(self.preferred_batch_size)
        self.priority_levels: int = _check_int("priority_levels", priority_levels, 0)
        self.default_priority_level: int = _check_default_level(
            default_priority_level, self.priority_levels)
        self._policies = _check_policies(priority_queue_policy, self.priority_levels,
                                         QueuePolicy(self.max_queue_size, self.timeout))
        self._delay = self.max_queue_delay_ms / 1000.0
        self._signature = self._model.signature.inputs
        self._accepted: dict = {}   # (shape, dtype) of a lone input -> (rows, single)
        self._spec = self._model.spec
        self._single_output = self._spec if isinstance(self._spec, int) else None
        replicas = self._model.replicas
        self._zeros = [torch.zeros((self.batch_size, *shape[1:]), dtype=dtype)
                       for shape, dtype in self._signature]
        # padding rows: less than a traced batch, or than the largest bucket
        pad_rows = self._model.buckets[-1] if self._model.buckets else self.batch_size
        self._padding = self._zeros if pad_rows == self.batch_size else [
            torch.zeros((pad_rows, *shape[1:]), dtype=dtype) for shape, dtype in self._signature]
        if warmup:
            self._warm_up()

        # reentrant: the runtime's SIGTERM handler closes the server on whatever the
        # main thread was doing, which may be a caller holding this lock
        self._lock = threading.RLock()
        self._reap_cv = threading.Condition(self._lock)   # the reaper waits here
        # one queue per priority level, the highest first (one queue without levels)
        self._queues: List[Deque[_Request]] = [
            collections.deque() for _ in range(max(1, self.priority_levels))]
        self._waiting = 0                                  # requests in the queues
        self._rows = 0                                     # rows of live queued requests
        self._deadlines: List[Tuple[float, int, _Request]] = []
        self._seq = itertools.count()
        self._closed = False
        self._slack = 0.0                                  # typical oversleep of a timed wait
        self._counts = collections.Counter()
        self._sizes = collections.Counter()               # rows per batch -> batches
        self._running: List[List[_Request]] = []          # per lane: its batch in flight
        self._direct: set = set()                          # requests sent by their caller
        self._busy: dict = {}                              # core -> batches in flight
        self._per_core = batches_per_core
        self._replicas = replicas
        self._next_direct = 0                              # spreads direct sends over cores
        self._deliveries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._reaper: Optional[threading.Thread] = None
        self._lanes: List[threading.Thread] = []
        # a lane waits on a condition of its own, so a wake-up goes to one that can act
        self._lane_cv: List[threading.Condition] = []
        self._parked: dict = {}    # waiting lanes (keys, in order); lane k serves k % replicas
        for slot in range(batches_per_core):
            for replica in range(replicas):
                lane = len(self._lanes)
                self._running.append([])
                self._lane_cv.append(threading.Condition(self._lock))
                t = threading.Thread(target=self._lane, args=(lane, replica), daemon=True,
                                     name=f"neuronmp-serve-r{replica}-{slot}")
                self._lanes.append(t)
        # the lanes start with the first request from a thread; a server whose first
        # caller is an event loop is served by that loop alone (batchloop.py)
        self._lanes_started = False
        self._sched: Optional[LoopScheduler] = None
        # at interpreter exit the runtime closes us before it stops the workers
        _runtime.get_runtime().add_shutdown_hook(self.close)

    # -- requests -----------------------------------------------------------------

    @property
    def cores(self) -> Tuple[int, ...]:
        """Global ids of the cores the model runs on now."""
        return self._model.cores

    def submit(self, *inputs: torch.Tensor, timeout: Any = _DEFAULT,
               priority: Optional[int] = None, into: Optional[Destination] = None) -> Future:
        """Queue one request; a Future of the model's outputs for these rows.

        ``timeout``: seconds, or None for none (default: the level's policy).
        ``priority``: 1 (highest) .. priority_levels; None or 0 is the default level.
        ``into``: buffers shaped as the model's whole traced outputs, which the core's
        answer is copied into when the request goes alone to its core with nothing
        padded (an idle server, exactly one traced batch of rows); the result then
        views them.  Otherwise they are left untouched.  Close it before reusing the
        buffers (see Destination): a request that failed may still be running.
        Raises at once (in the caller) for inputs that do not fit the traced model or a
        priority out of range, QueueFullError when ``max_queue_size`` requests wait at
        the request's level, ServerClosedError after close().
        """
        return self._enqueue(inputs, timeout, Answer(), priority, into).future

    def _request(self, inputs: Sequence[torch.Tensor], timeout: Any, future,
                 priority: Optional[int]) -> Tuple[_Request, QueuePolicy]:
        """A checked request and its level's policy (raises in the caller)."""
        level = self._level(priority)
        policy = self._policies[level]
        timeout = policy.timeout if timeout is _DEFAULT else (
            None if timeout is None else _check_number("timeout", timeout))
        return _Request(*self._normalise(inputs), timeout, future, level), policy

    def _enqueue(self, inputs: Sequence[torch.Tensor], timeout: Any, future,
                 priority: Optional[int] = None,
                 into: Optional[Destination] = None) -> _Request:
        req, policy = self._request(inputs, timeout, future, priority)
        sched = self._scheduler()
        if sched is not None:   # an event loop serves this server: its queues
            req.into = into
            sched.submit(req, policy)
            return req
        queue = self._queues[req.level]
        with self._lock:
            if self._closed:
                raise ServerClosedError("the BatchingServer is closed; no new requests")
            if not self._lanes_started:
                self._lanes_started = True
                for t in self._lanes:
                    t.start()
            if policy.max_queue_size is not None and len(queue) >= policy.max_queue_size:
                self._counts["rejected"] += 1
                raise QueueFullError(policy.max_queue_size, len(queue),
                                     req.level + 1 if self.priority_levels else None)
            self._counts["submitted"] += 1
            core = self._direct_core()
            if core is None:
                self._queue(req, queue)
            else:   # a slot of an idle core, taken under the lock the lanes take theirs
                self._busy[core] = self._busy.get(core, 0) + 1
                req.queued = False
                self._direct.add(req)
                self._counts["direct"] += 1
                self._count_batch([req], req.rows, time.monotonic())
            if req.deadline is not None:
                self._track_deadline(req)
        if core is not None:
            req.future.set_running_or_notify_cancel()   # fresh: nobody could cancel it yet
            self._send_direct(req, core, into)
        return req

    def _queue(self, req: _Request, queue: Deque[_Request]) -> None:
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

    def _level(self, priority: Optional[int]) -> int:
        """The queue index (0 = level 1, the highest) for a request's ``priority``."""
        if priority is None or priority == 0:
            return self.default_priority_level - 1 if self.priority_levels else 0
        if isinstance(priority, bool) or not isinstance(priority, int) or \
                not 1 <= priority <= self.priority_levels:
            accepted = (f"1 (highest) .. {self.priority_levels}, or 0/None for the default "
                        f"level {self.default_priority_level}" if self.priority_levels else
                        "0 or None: this server has no priority_levels")
            raise ValueError(f"BatchingServer: priority {priority!r} is not a level; "
                             f"accepted: {accepted}")
        return priority - 1

    def infer(self, *inputs: torch.Tensor, timeout: Any = _DEFAULT,
              priority: Optional[int] = None, into: Optional[Destination] = None) -> Any:
        """Submit and wait for the result (raises the request's error; ``into`` as for
        :meth:`submit`)."""
        sched = self._sched
        if sched is not None and sched.thread == threading.get_ident() and sched.usable:
            raise RuntimeError("BatchingServer.infer() on the event loop that serves the "
                               "server would block that loop: await infer_async() there")
        return self._enqueue(inputs, timeout, Answer(), priority, into).future.result()

    async def infer_async(self, *inputs: torch.Tensor, timeout: Any = _DEFAULT,
                          priority: Optional[int] = None,
                          into: Optional[Destination] = None) -> Any:
        """``await server.infer_async(x)``: the same as :meth:`infer`, for asyncio code
        (``into`` as for :meth:`submit`)."""
        loop = asyncio.get_running_loop()
        sched = self._sched
        if sched is None or sched.loop is not loop:
            sched = self._bind(loop)
        if sched is not None:   # this loop forms the batches and reads the cores
            waiter = loop.create_future()
            req, policy = self._request(inputs, timeout, waiter, priority)
            req.into = into
            sched.submit(req, policy)
            return await waiter   # cancelled: still queued, it is skipped
        answer = self.submit(*inputs, timeout=timeout, priority=priority, into=into)
        waiter = loop.create_future()
        self._delivery(loop).add(answer, waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            answer.cancel()   # still queued: the lanes skip it (running: it finishes)
            raise

    def _scheduler(self) -> Optional[LoopScheduler]:
        """The event loop scheduler serving this server, if one does (its loop open)."""
        sched = self._sched
        if sched is None or sched.usable:
            return sched
        with self._lock:
            if self._sched is sched:
                self._sched = None
        sched.orphan()
        return None

    def _bind(self, loop: asyncio.AbstractEventLoop) -> Optional[LoopScheduler]:
        """Serve ``loop`` from itself, unless threads (the lanes) or another open
        loop serve this server already; None then."""
        current = self._scheduler()
        if current is not None:
            return current if current.loop is loop else None
        with self._lock:
            if self._lanes_started or self._closed or self._sched is not None:
                return self._sched if self._sched is not None and \
                    self._sched.loop is loop else None
            self._sched = LoopScheduler(self, loop)
            return self._sched

    def _delivery(self, loop: asyncio.AbstractEventLoop) -> _Delivery:
        delivery = self._deliveries.get(loop)
        if delivery is None:
            with self._lock:
                delivery = self._deliveries.setdefault(loop, _Delivery(loop))
        return delivery

    def _normalise(self, inputs: Sequence[torch.Tensor]) -> Tuple[tuple, int, bool]:
        """(inputs, rows, single) or a clear error naming the bad input (single
        samples keep their shape; the lane stacks them).  A lone CPU tensor of a
        shape and dtype accepted before is not checked again (serving callers send
        the same few shapes: the check was a tenth of the event loop's work)."""
        if len(inputs) == 1:
            x = inputs[0]
            if type(x) is torch.Tensor and x.is_cpu:
                key = (x.shape, x.dtype)
                hit = self._accepted.get(key)
                if hit is not None:
                    return inputs, hit[0], hit[1]
                got = self._model.signature.request(inputs, self.max_batch_size,
                                                    "BatchingServer")
                if len(self._accepted) < 64:
                    self._accepted[key] = got[1:]
                return got
        return self._model.signature.request(inputs, self.max_batch_size, "BatchingServer")

    # -- lanes: form a batch, run it on this lane's core, answer the callers ----------

    def _lane(self, lane: int, core: int) -> None:
        """Lane ``lane`` serves replica ``core`` (an index into the model's cores)."""
        while True:
            batch = self._next_batch(lane, core)
            if batch is None:
                return
            self._running[lane] = batch
            try:
                self._run(batch, core)
            finally:
                # after its callers are answered, unlike a direct send: freed before,
                # the slot let the next batch go before they sent again, and batches
                # shrank (bench_serve, 16 clients: 13 rows a batch down to 11,
                # 3,700 req/s against 4,900)
                self._running[lane] = []
                with self._lock:
                    self._release(core)

    def _release(self, core: int, direct: bool = False) -> None:
        """A batch of ``core`` is answered: its slot is free again (lock held)."""
        self._busy[core] -= 1
        # a lane releasing its slot looks for its next batch itself; after a direct
        # send, a lane of this core may have been held back by the slot it took
        if self._waiting and direct:
            self._wake(core)

    def _wake(self, core: Optional[int] = None) -> None:
        """Wake one waiting lane that can take a batch now (lock held): of a free
        core if there is one (it need not wait for company once the delay is out),
        else of a core with a free slot; only lanes of ``core`` if given.  Lanes of
        full cores stay asleep: a wake-up they cannot act on was lost work for the
        lane that could (and every lane waking on every arrival made the lanes and
        the callers queue for the lock and the GIL in turn)."""
        chosen = None
        for lane in self._parked:
            c = lane % self._replicas
            busy = self._busy.get(c, 0)
            if (core is not None and c != core) or busy >= self._per_core:
                continue
            if not busy:
                chosen = lane
                break
            if chosen is None:
                chosen = lane
        if chosen is not None:
            del self._parked[chosen]
            self._lane_cv[chosen].notify()

    def _wake_all(self) -> None:
        for lane in self._parked:
            self._lane_cv[lane].notify()
        self._parked.clear()

    def _park(self, lane: int, timeout: Optional[float] = None) -> bool:
        """Wait (lock held) until woken by _wake or the timeout; False on timeout."""
        self._parked[lane] = None
        try:
            return self._lane_cv[lane].wait(timeout)
        finally:
            self._parked.pop(lane, None)

    def _next_batch(self, lane: int, core: int) -> Optional[List[_Request]]:
        """Wait until a batch is due for ``core``, and take it.

        Due when it is full (a busy core queues it behind its running batch), or,
        when ``core`` has no batch in flight, once its oldest request has waited
        max_queue_delay_ms -- or at once when no core of the server is running a
        batch: an idle server gains nothing from waiting.  So a lone caller pays no
        queue delay, while under load batches fill up as they should: every batch
        costs a whole traced batch of compute, padded or not, and a partial batch
        sent to a busy core would only wait in its ring, no sooner served.
        With preferred batch sizes, "full" is the largest preferred size (or no room
        left for the next request), a free core takes any preferred size it can form,
        and a partial batch waits out the delay even on an idle server.
        """
        with self._lock:
            while True:
                if self._closed:
                    return None
                if self._waiting and self._busy.get(core, 0) < self._per_core:
                    free = not self._busy.get(core)
                    limit, wait = self._due(free)
                    if limit:
                        batch = self._take(limit)
                        if self._waiting:      # the rest starts another lane's clock
                            self._wake()
                        if batch:
                            self._busy[core] = self._busy.get(core, 0) + 1
                            return batch
                        continue
                    if free:
                        self._sleep_until_due(lane, wait)
                    else:   # until a batch fills up or this core is free again
                        self._park(lane)
                else:
                    self._park(lane)

    def _due(self, free: bool) -> Tuple[int, float]:
        """(rows to take now, 0 if none; seconds until the oldest request's delay is
        out), the lock held; ``free``: this lane's core runs no batch."""
        if len(self._queues) == 1:
            oldest = self._queues[0][0].arrival
        else:
            oldest = min(q[0].arrival for q in self._queues if q)
        wait = oldest + self._delay - time.monotonic()
        if not self._preferred:
            if self._rows >= self.max_batch_size or (free and (
                    wait <= 0 or not any(self._busy.values()))):
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

    def _sleep_until_due(self, lane: int, wait: float) -> None:
        """Wait (lock held) for the oldest request's due time, waking early by the
        usual oversleep: a timed wait returns late by the scheduler's latency, and the
        delay is a bound on the time a request is held."""
        target = time.monotonic() + wait
        if not self._park(lane, max(0.0, wait - self._slack)):
            late = time.monotonic() - (target - self._slack)
            slack = 0.8 * self._slack + 0.2 * max(0.0, late)
            self._slack = min(slack, self._delay / 2)

    def _take(self, limit: int) -> List[_Request]:
        """Pop requests up to ``limit`` rows, the highest priority level first and FIFO
        within a level, stopping at the first that does not fit; skip cancelled and
        expired ones."""
        batch: List[_Request] = []
        rows = 0
        now = time.monotonic()
        for q in self._queues:
            while q and rows + q[0].rows <= limit:
                req = q.popleft()
                self._waiting -= 1
                self._rows -= req.rows
                req.queued = False
                try:
                    if not req.future.set_running_or_notify_cancel():
                        continue          # cancelled by its caller
                except RuntimeError:      # already failed (timed out)
                    continue
                batch.append(req)
                rows += req.rows
            if q:
                break   # its head does not fit: lower levels do not jump it
        if batch:
            self._count_batch(batch, rows, now)
        return batch

    def _count_batch(self, batch: List[_Request], rows: int, now: float) -> None:
        """Count a batch formed at ``now`` and its requests' time in the queue (lock held)."""
        self._counts["queue_us"] += sum(now - r.arrival for r in batch) * 1e6
        self._counts["batches"] += 1
        self._counts["rows"] += rows
        self._sizes[rows] += 1

    def _run(self, batch: List[_Request], replica: int) -> None:
        rows = sum(r.rows for r in batch)
        pad, _ = chunking.plan(rows, self.batch_size, 1)
        try:
            # padded here, in the one stack that assembles the batch: the model's
            # plan then has nothing to pad or strip
            args = [self._assemble(batch, i, pad) for i in range(len(self._signature))]
            t0 = time.monotonic()
            outs = self._model.submit(args, replica=replica, dynamic=True).result()
            with self._lock:
                self._counts["compute_us"] += (time.monotonic() - t0) * 1e6
            self._answer(batch, outs, rows + pad)
        except BaseException as exc:  # noqa: BLE001 - every caller must hear of it
            self._fail(batch, exc)
            if not isinstance(exc, Exception):
                raise

    # -- direct sends: an idle server's request goes from its caller to a core ----------

    def _direct_core(self) -> Optional[int]:
        """A core for a request to go to straight from its caller, or None (lock held).

        Only when a lane would send it at once too: nothing queued (so it jumps no
        one), no preferred sizes to wait for, and no batch running anywhere (an idle
        server; with no delay, any core without a batch).  Then the lanes' hand-off
        (waking a lane, which then waits for the core) is all the request would gain
        from them, and on a small request it was the largest cost.
        """
        if self._waiting or self._preferred or (self._delay > 0 and any(self._busy.values())):
            return None
        for i in range(self._replicas):
            core = (self._next_direct + i) % self._replicas
            if not self._busy.get(core):
                self._next_direct = core + 1
                return core
        return None

    def _send_direct(self, req: _Request, core: int, into: Optional[Destination]) -> None:
        """Send a one-request batch to ``core`` from the caller's thread; the core's
        answer is handled by whichever thread reads it (the core's reader), and
        written into ``into`` if the batch is the request's rows alone."""
        rows = req.rows
        pad, _ = chunking.plan(rows, self.batch_size, 1)
        req.sender = threading.get_ident()
        try:
            args = [self._assemble([req], i, pad) for i in range(len(self._signature))]
            t0 = time.monotonic()
            answer = self._model.submit(args, replica=core, dynamic=True,
                                        into=None if pad else into)
        except BaseException as exc:  # noqa: BLE001 - the caller hears of it by its future
            self._direct_done(req, core, 0.0, rows + pad, None, exc)
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            req.sender = 0
        answer.add_done_callback(
            lambda a: self._direct_done(req, core, t0, rows + pad, a, None))

    def _direct_done(self, req: _Request, core: int, t0: float, total: int,
                     answer: Optional[Future], exc: Optional[BaseException]) -> None:
        """Free the core's slot, then answer (or fail) the request: the slot first, so
        a caller that sends its next request the moment it is answered finds the
        server idle again."""
        with self._lock:
            if t0:
                self._counts["compute_us"] += (time.monotonic() - t0) * 1e6
            self._direct.discard(req)
            self._release(core, direct=True)
        try:
            if exc is None:
                exc = answer.exception()   # done: no wait
            if exc is None:
                self._answer([req], answer.result(), total)
                return
        except BaseException as err:  # noqa: BLE001 - e.g. an output of the wrong shape
            exc = err
        self._fail([req], exc)

    def _assemble(self, batch: List[_Request], i: int, pad: int) -> torch.Tensor:
        """Input ``i`` of the batch: one stack of single samples (the usual case) or
        one cat of rows, zero-padded (always less than one traced batch)."""
        if len(batch) == 1 and not pad:
            # a view: the ring copies it anyway, and a copy of a large input here runs
            # on torch's intra-op threads, which then spin on the caller's CPUs
            req = batch[0]
            return req.inputs[i].unsqueeze(0) if req.single else req.inputs[i]
        if all(r.single for r in batch):
            parts = [r.inputs[i] for r in batch]
            if pad:
                parts.extend([self._padding[i][0]] * pad)
            return torch.stack(parts)
        parts = [r.inputs[i].unsqueeze(0) if r.single else r.inputs[i] for r in batch]
        if pad:
            parts.append(self._padding[i][:pad])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _answer(self, batch: List[_Request], outs: List[torch.Tensor], total: int) -> None:
        values = self._values(batch, outs, total)
        woken = []
        for req, value in zip(batch, values):
            try:
                req.future.settle(value)   # woken all at once below
                woken.append(req.future)
            except InvalidStateError:  # timed out meanwhile: counted as that, not as done
                pass
        with self._lock:  # counted before a blocked caller wakes with its answer
            self._counts["completed"] += len(woken)
        wake_answers(woken)

    def _values(self, batch: List[_Request], outs: List[torch.Tensor], total: int) -> list:
        """Each request's rows of a batch's outputs, in the traced output structure."""
        for o in outs:
            if o.dim() == 0 or o.shape[0] != total:
                raise ValueError(
                    f"BatchingServer: the model returned an output of shape {list(o.shape)} "
                    f"for a batch of {total} rows; served models must keep the batch in "
                    "dim 0 of every output"
                )
        start, single_out, spec = 0, self._single_output, self._spec
        if len(batch) > 1 and not any(r.single for r in batch):
            return self._split(batch, outs, total)
        rows_of = None  # per output, its rows as views: one call instead of one per row
        values = []
        for req in batch:
            if req.single:
                if rows_of is None:
                    rows_of = [o.unbind(0) for o in outs]
                value = rows_of[single_out][start] if single_out is not None else \
                    pytree.unflatten([r[start] for r in rows_of], spec)
            else:
                flat = [o[start:start + req.rows] for o in outs]
                value = flat[single_out] if single_out is not None else pytree.unflatten(flat, spec)
            start += req.rows
            values.append(value)
        return values

    def _split(self, batch: List[_Request], outs: List[torch.Tensor], total: int) -> list:
        """``_values`` for requests of rows: one split per output, not a slice per request."""
        sizes = [r.rows for r in batch]
        rows = sum(sizes)
        if rows < total:
            sizes.append(total - rows)   # the padding, dropped
        parts = [o.split(sizes) for o in outs]
        if self._single_output is not None:
            return list(parts[self._single_output][:len(batch)])
        return [pytree.unflatten([p[k] for p in parts], self._spec) for k in range(len(batch))]

    @staticmethod
    def _copy_error(exc: BaseException) -> BaseException:
        return _copy(exc)

    def _fail(self, batch: List[_Request], exc: BaseException) -> None:
        with self._lock:
            self._counts["failed"] += len(batch)
        for req in batch:
            try:
                req.future.set_exception(_copy(exc))
            except InvalidStateError:
                pass

    # -- timeouts ---------------------------------------------------------------

    def _track_deadline(self, req: _Request) -> None:
        """Remember a deadline (lock held); start or wake the reaper when it comes first."""
        heapq.heappush(self._deadlines, (req.deadline, next(self._seq), req))
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap, daemon=True,
                                            name="neuronmp-serve-timeouts")
            self._reaper.start()
        elif self._deadlines[0][2] is req:
            self._reap_cv.notify()

    def _reap(self) -> None:
        while True:
            expired = []
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, _, req = heapq.heappop(self._deadlines)
                    if req.future.done():
                        continue
                    if req.queued:
                        self._queues[req.level].remove(req)
                        self._waiting -= 1
                        self._rows -= req.rows
                        req.queued = False
                    expired.append(req)
                self._counts["timed_out"] += len(expired)
                if not expired:
                    wait = self._deadlines[0][0] - now if self._deadlines else None
                    self._reap_cv.wait(wait)
                    continue
            for req in expired:  # outside the lock: callbacks may call submit()
                stage = ("running" if req.future.running() else "waiting in the queue")
                try:
                    req.future.set_exception(RequestTimeoutError(req.timeout, stage))
                except InvalidStateError:
                    pass

    # -- life cycle -------------------------------------------------------------

    def close(self, timeout: float = _CLOSE_GRACE) -> None:
        """Fail waiting requests (ServerClosedError), finish running batches, stop threads.

        Idempotent.  Batches still running after ``timeout`` seconds fail too.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sched, self._sched = self._sched, None
            waiting = [req for q in self._queues for req in q]
            for q in self._queues:
                q.clear()
            self._waiting = 0
            self._rows = 0
            self._wake_all()
            self._reap_cv.notify_all()
        if sched is not None:
            sched.close(waiting, timeout)
            waiting = []
        err = ServerClosedError("the BatchingServer was closed before this request ran")
        for req in waiting:
            try:
                req.future.set_exception(_copy(err))
            except InvalidStateError:
                pass
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        for t in self._lanes + ([self._reaper] if self._reaper else []):
            if t is not me and t.ident is not None:
                t.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            direct = list(self._direct)
        mine = threading.get_ident()
        for req in direct:   # settled by the cores' readers, not by a thread of ours
            if req.sender != mine:   # (this thread's own send, interrupted by a signal
                # handler that closes the server, cannot finish while we wait for it)
                req.future.wait_done(max(0.0, deadline - time.monotonic()))
        stuck = ServerClosedError(
            f"the BatchingServer was closed while this request still ran after {timeout:g} s")
        for batch in self._running + [direct]:
            for req in list(batch):
                try:
                    req.future.set_exception(_copy(stuck))
                except InvalidStateError:
                    pass

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> BatchingServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        """Counters since start: submitted, rejected, batches, rows, completed, failed,
        timed_out, direct (batches sent by their caller, the server being idle),
        queue_us (summed over requests: submission to batch), compute_us (summed over
        batches: sent to the core until answered), running (batches on the cores now),
        queued (now), queued_by_level (now, level 1 first; one entry without levels),
        batch_sizes ({rows: batches formed of that many rows}) and mean rows per batch."""
        with self._lock:
            c = dict(self._counts)
            by_level = [len(q) for q in self._queues]
            sizes = dict(self._sizes)
            running = sum(self._busy.values())
        out = {k: c.get(k, 0) for k in ("submitted", "rejected", "batches", "rows",
                                        "completed", "failed", "timed_out", "direct",
                                        "queue_us", "compute_us")}
        out["running"] = running
        out["queued"] = sum(by_level)
        out["queued_by_level"] = by_level
        out["batch_sizes"] = sizes
        out["mean_batch_rows"] = out["rows"] / out["batches"] if out["batches"] else 0.0
        return out

    def _warm_up(self) -> None:
        """One zero batch on every core: checks the outputs and warms the workers."""
        answers = [self._model.submit(self._zeros, replica=k)
                   for k in range(self._model.replicas)]
        for answer in answers:
            outs = answer.result()
            for o in outs:
                if o.dim() == 0 or o.shape[0] != self.batch_size:
                    raise ValueError(
                        f"BatchingServer: the model returned an output of shape "
                        f"{list(o.shape)} for a batch of {self.batch_size}; served models "
                        "must keep the batch in dim 0 of every output"
                    )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"<neuronmp BatchingServer cores={list(self.cores)} batch={self.batch_size} "
                f"max_batch_size={self.max_batch_size} delay={self.max_queue_delay_ms:g}ms "
                f"{state}>")


class _Delivery:
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


# -- helpers ------------------------------------------------------------------------


def _traced_batch(model: _model.Model) -> int:
    if not model.batch:
        raise ValueError(
            "BatchingServer needs a model whose traced inputs share their dim-0 (batch) "
            f"size; this one was traced with {model.describe_signature()}"
        )
    return int(model.batch)


def _check_int(name: str, value: Any, low: int, default: Optional[int] = None) -> int:
    if value is None and default is not None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"BatchingServer: {name} must be an int >= {low}, got {value!r}")
    return value


def _check_preferred(sizes: Sequence[int], max_batch_size: int) -> Tuple[int, ...]:
    if isinstance(sizes, int) or not isinstance(sizes, (list, tuple)):
        raise ValueError("BatchingServer: preferred_batch_size must be a list of row "
                         f"counts, got {sizes!r}")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or \
                not 1 <= size <= max_batch_size:
            raise ValueError(f"BatchingServer: preferred_batch_size {size!r} is not a row "
                             f"count in 1..max_batch_size ({max_batch_size})")
    return tuple(sorted(set(sizes)))


def _check_default_level(level: Optional[int], levels: int) -> int:
    if level is None:
        return levels            # the lowest level (0 without levels)
    if not levels:
        if level != 0:
            raise ValueError(f"BatchingServer: default_priority_level {level!r} needs "
                             "priority_levels >= 1; without levels it is 0")
        return 0
    if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= levels:
        raise ValueError(f"BatchingServer: default_priority_level must be in 1..{levels} "
                         f"(priority_levels), got {level!r}")
    return level


def _check_policies(given: Optional[Mapping[int, QueuePolicy]], levels: int,
                    default: QueuePolicy) -> List[QueuePolicy]:
    """One policy per queue: the level's own, else the default one."""
    given = dict(given or {})
    for level, policy in given.items():
        if not levels or isinstance(level, bool) or not isinstance(level, int) or \
                not 1 <= level <= levels:
            raise ValueError(f"BatchingServer: priority_queue_policy level {level!r} is not "
                             f"one of the priority levels 1..{levels}")
        if not isinstance(policy, QueuePolicy):
            raise TypeError("BatchingServer: priority_queue_policy values must be "
                            f"QueuePolicy, got {type(policy).__name__} for level {level}")
        if policy.max_queue_size is not None:
            _check_int(f"priority_queue_policy[{level}].max_queue_size",
                       policy.max_queue_size, 1)
        if policy.timeout is not None:
            _check_number(f"priority_queue_policy[{level}].timeout", policy.timeout)
    return [given.get(k + 1, default) for k in range(max(1, levels))]


def _check_number(name: str, value: Any, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        value >= 0 if allow_zero else value > 0) and value == value and value != float("inf")
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"BatchingServer: {name} must be a finite number {bound}, "
                         f"got {value!r}")
    return float(value)


def _copy(exc: BaseException) -> BaseException:
    """A fresh instance per caller, so tracebacks raised in many threads do not mix."""
    if isinstance(exc, NeuronmpError):
        try:
            fn, args = exc.__reduce__()
            return fn(*args)
        except Exception:  # an error that cannot rebuild itself is shared as is
            return exc
    return exc
