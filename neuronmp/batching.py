"""Serving: a dynamic-batching request server over a traced model's cores.

    callers (threads / asyncio)       BatchingServer (this module: its public face)
    submit / infer / infer_async ─▶ check the inputs once (Signature.request)
                                    ─▶ a queue per priority level   (batchpolicy.py)
         one of two paths, fixed by the first caller:
         threads:    lanes, one per replica x batches_per_core; an idle server's
                     request sent by its caller; the timeout reaper (batchlanes.py)
         event loop: the loop forms the batches and owns the cores' rings
                     (batchloop.py, docs/guides/event-loop-serving.md)
                                    ─▶ stack + zero-pad (_assemble) ─▶ the model's
                                       replica k (model.submit / Session.loop_channel)
    each caller's rows of the outputs (_values) ◀─────────────────────────────────┘

The rooms: batchconfig.py checks the arguments (QueuePolicy); batchpolicy.py is
the scheduling policy, pure logic (which requests make a batch, when it is due);
batchlanes.py the threads; batchloop.py the asyncio side (a loop that serves the
server, and ``Delivery``, which hands a thread-served server's answers to asyncio
callers in bulk).  This module holds the state they share, the request checks,
the batch's assembly and split, and the life cycle.

The number of lanes is fixed when the server starts (place the model first:
``set_multicore``, ``set_neuron_cores``); which core a replica index means is
asked of the model at every batch, so the server follows a model that is moved
later, or loaded again after a runtime restart.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError
from typing import Any, Deque, List, Mapping, Optional, Sequence, Tuple

import torch

from .batchconfig import (
    QueuePolicy,
    check_default_level,
    check_int,
    check_number,
    check_policies,
    check_preferred,
    check_priority,
    traced_batch,
)
from .batchlanes import Claimed, Lanes, copy_error
from .batchloop import Delivery, LoopScheduler
from .batchpolicy import Policy, Request
from .batchrows import Rows
from .errors import QueueFullError, RequestTimeoutError, ServerClosedError
from .host import runtime as _runtime
from .pool.answer import Answer, Destination
from .session import model as _model

__all__ = ["BatchingServer", "QueuePolicy", "QueueFullError", "RequestTimeoutError",
           "ServerClosedError"]

_DEFAULT: Any = object()   # "use the server's timeout"
_CLOSE_GRACE = 10.0


class BatchingServer(Policy, Lanes, Rows):
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
    (as in Triton's dynamic batcher, the delay bounds the wait for company, not the wait
    for a core).  Unlike Triton's, an idle server sends at once unless
    ``wait_when_idle`` is set.

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

    ``wait_when_idle``: a partial batch waits out ``max_queue_delay_ms`` even when no
    core runs a batch, as Triton's dynamic batcher waits (neuronmp-serve sets it).  By
    default an idle server sends a request at once: the least latency when requests
    are few, but under a steady load whose cores fall idle between batches it sends
    batches of a few rows, and each costs a model call (docs/performance.md, serving
    section).

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
                 priority_queue_policy: Optional[Mapping[int, QueuePolicy]] = None,
                 wait_when_idle: bool = False):
        if not _model.is_traced(model):
            raise TypeError(
                "BatchingServer expects a model made by neuronmp.trace, got "
                f"{type(model).__name__}"
            )
        self._model = _model.model_of(model)
        buckets = self._model.buckets   # then the model pads each batch to its bucket
        self.batch_size: int = 1 if buckets else traced_batch(self._model)
        self.max_batch_size: int = check_int("max_batch_size", max_batch_size, 1,
                                              default=buckets[-1] if buckets else self.batch_size)
        if buckets and self.max_batch_size > buckets[-1]:
            # a batch runs in one graph: the event loop sends it whole, as one bucket
            raise ValueError(f"max_batch_size={self.max_batch_size} is larger than the model's "
                             f"largest batch bucket ({buckets[-1]}): accepted 1 to {buckets[-1]}")
        self.max_queue_delay_ms: float = check_number("max_queue_delay_ms",
                                                       max_queue_delay_ms, allow_zero=True)
        self.max_queue_size: Optional[int] = (
            None if max_queue_size is None else check_int("max_queue_size", max_queue_size, 1))
        self.timeout: Optional[float] = (
            None if timeout is None else check_number("timeout", timeout))
        batches_per_core = check_int("batches_per_core", batches_per_core, 1)
        self.preferred_batch_size: Tuple[int, ...] = check_preferred(
            preferred_batch_size, self.max_batch_size)
        self._preferred = frozenset(self.preferred_batch_size)
        self.priority_levels: int = check_int("priority_levels", priority_levels, 0)
        self.default_priority_level: int = check_default_level(
            default_priority_level, self.priority_levels)
        self._default_index = check_priority(None, self.priority_levels,
                                             self.default_priority_level)
        self._policies = check_policies(priority_queue_policy, self.priority_levels,
                                         QueuePolicy(self.max_queue_size, self.timeout))
        self._delay = self.max_queue_delay_ms / 1000.0
        if not isinstance(wait_when_idle, bool):
            raise TypeError(f"wait_when_idle must be True or False, got {wait_when_idle!r}")
        self.wait_when_idle: bool = wait_when_idle
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

        # reentrant: a user's signal handler that closes the server runs on the main
        # thread wherever it was, maybe in a caller holding this lock (the runtime's
        # own SIGTERM shutdown runs on a thread of its own and just waits for it)
        self._lock = threading.RLock()
        self._reap_cv = threading.Condition(self._lock)   # the reaper waits here
        # one queue per priority level, the highest first (one queue without levels)
        self._queues: List[Deque[Request]] = [
            collections.deque() for _ in range(max(1, self.priority_levels))]
        self._waiting = 0                                  # requests in the queues
        self._rows = 0                                     # rows of live queued requests
        self._deadlines: List[Tuple[float, int, Request]] = []
        self._seq = itertools.count()
        self._closed = False
        self._slack = 0.0                                  # typical oversleep of a timed wait
        self._counts = collections.Counter()
        self._sizes = collections.Counter()               # rows per batch -> batches
        self._direct: set = set()                          # requests sent by their caller
        self._busy: dict = {}                              # replica -> batches in flight
        self._per_replica = batches_per_core
        self._replicas = replicas
        self._next_direct = 0                              # spreads direct sends over cores
        self._deliveries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._reaper: Optional[threading.Thread] = None
        # the lanes start with the first request from a thread; a server whose first
        # caller is an event loop is served by that loop alone (batchloop.py)
        self._make_lanes(batches_per_core, replicas)
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
        return self._enqueue(inputs, timeout, False, priority, into).future

    def _request(self, inputs: Sequence[torch.Tensor], timeout: Any, future,
                 priority: Optional[int]) -> Tuple[Request, QueuePolicy]:
        """A checked request and its level's policy (raises in the caller)."""
        level = self._level(priority)
        policy = self._policies[level]
        timeout = policy.timeout if timeout is _DEFAULT else (
            None if timeout is None else check_number("timeout", timeout))
        return Request(*self._normalise(inputs), timeout, future, level), policy

    def _enqueue(self, inputs: Sequence[torch.Tensor], timeout: Any, blocking: bool,
                 priority: Optional[int] = None,
                 into: Optional[Destination] = None) -> Request:
        """Queue a request; its future is a Future (an Answer), or for a ``blocking``
        caller served by the threads a Claimed (it only waits in ``result()``)."""
        sched = self._scheduler()
        req, policy = self._request(
            inputs, timeout, Claimed() if blocking and sched is None else Answer(), priority)
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
            replica = self._direct_replica()
            if replica is None:
                self._queue(req, queue)
            else:   # a slot of an idle replica, taken under the lock the lanes take theirs
                self._busy[replica] = self._busy.get(replica, 0) + 1
                req.queued = False
                self._direct.add(req)
                self._counts["direct"] += 1
                self._count_batch([req], req.rows, time.monotonic(), req.arrival)
            if req.deadline is not None:
                self._track_deadline(req)
        if replica is not None:
            req.future.set_running_or_notify_cancel()   # fresh: nobody could cancel it yet
            self._send_direct(req, replica, into)
        return req

    def _level(self, priority: Optional[int]) -> int:
        """The queue index (0 = level 1, the highest) for a request's ``priority``."""
        return check_priority(priority, self.priority_levels, self.default_priority_level)

    def infer(self, *inputs: torch.Tensor, timeout: Any = _DEFAULT,
              priority: Optional[int] = None, into: Optional[Destination] = None) -> Any:
        """Submit and wait for the result (raises the request's error; ``into`` as for
        :meth:`submit`)."""
        sched = self._sched
        if sched is not None and sched.thread == threading.get_ident() and sched.usable:
            raise RuntimeError("BatchingServer.infer() on the event loop that serves the "
                               "server would block that loop: await infer_async() there")
        return self._enqueue(inputs, timeout, True, priority, into).future.result()

    async def infer_async(self, *inputs: torch.Tensor, timeout: Any = _DEFAULT,
                          priority: Optional[int] = None,
                          into: Optional[Destination] = None) -> Any:
        """``await server.infer_async(x)``: the same as :meth:`infer`, for asyncio code
        (``into`` as for :meth:`submit`)."""
        loop = asyncio.get_running_loop()
        sched = self._sched
        if sched is not None and sched.loop is loop and timeout is _DEFAULT and \
                priority is None and into is None:
            waiter = self._loop_request(sched, loop, inputs)
        else:
            waiter = self.loop_future(loop, *inputs, timeout=timeout, priority=priority,
                                      into=into)
        if waiter is not None:
            return await waiter   # cancelled: still queued, it is skipped
        answer = self.submit(*inputs, timeout=timeout, priority=priority, into=into)
        waiter = loop.create_future()
        self._delivery(loop).add(answer, waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            answer.cancel()   # still queued: the lanes skip it (running: it finishes)
            raise

    def loop_future(self, loop: asyncio.AbstractEventLoop, *inputs: torch.Tensor,
                    timeout: Any = _DEFAULT, priority: Optional[int] = None,
                    into: Optional[Destination] = None) -> Optional[asyncio.Future]:
        """:meth:`infer_async`'s request as a future of ``loop`` (called on it), for
        callers that answer from a done callback rather than a task (the HTTP front
        end); None when ``loop`` does not form this server's batches (threads or
        another loop do: use :meth:`infer_async`).  Raises as :meth:`submit` does."""
        sched = self._sched
        if sched is None or sched.loop is not loop:
            sched = self._bind(loop)
        if sched is None:
            return None
        waiter = loop.create_future()
        req, policy = self._request(inputs, timeout, waiter, priority)
        req.into = into
        sched.submit(req, policy)
        return waiter

    def _loop_request(self, sched: LoopScheduler, loop: asyncio.AbstractEventLoop,
                      inputs: Sequence[torch.Tensor]) -> asyncio.Future:
        """:meth:`loop_future` for the usual call (on the loop this server's ``sched``
        serves; the default level and timeout, no ``into``): what ``_request`` would
        compute for it is the server's own, fixed at start, so a request costs only
        its check (once per shape) and its queueing (the event loop's CPU per
        request is what bounds the rows it serves)."""
        waiter = loop.create_future()
        x = inputs[0] if len(inputs) == 1 else None
        hit = self._accepted.get((x.shape, x.dtype)) \
            if type(x) is torch.Tensor and x.is_cpu else None   # _normalise's, inlined
        if hit is None:
            inputs, rows, single = self._normalise(inputs)
        else:
            rows, single = hit
        level = self._default_index
        policy = self._policies[level]
        sched.submit(Request(inputs, rows, single, policy.timeout, waiter, level), policy,
                     True)
        return waiter

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

    def _delivery(self, loop: asyncio.AbstractEventLoop) -> Delivery:
        delivery = self._deliveries.get(loop)
        if delivery is None:
            with self._lock:
                delivery = self._deliveries.setdefault(loop, Delivery(loop))
        return delivery

    @staticmethod
    def _copy_error(exc: BaseException) -> BaseException:
        return copy_error(exc)

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
                req.future.set_exception(copy_error(err))
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
                    req.future.set_exception(copy_error(stuck))
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
        """A zero batch of every size the server will run, on every core: checks the
        outputs and warms the workers.  A bucketed model runs a graph per bucket,
        each loaded and first run on its own: every bucket up to the one that holds
        ``max_batch_size`` is warmed here, so no caller's request pays for it."""
        sizes = self._batch_sizes_run()
        answers = [(rows, self._model.submit([z[:rows] for z in self._padding], replica=k))
                   for rows in sizes for k in range(self._model.replicas)]
        for rows, answer in answers:
            for o in answer.result():
                if o.dim() == 0 or o.shape[0] != rows:
                    raise ValueError(
                        f"BatchingServer: the model returned an output of shape "
                        f"{list(o.shape)} for a batch of {rows}; served models "
                        "must keep the batch in dim 0 of every output"
                    )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"<neuronmp BatchingServer cores={list(self.cores)} batch={self.batch_size} "
                f"max_batch_size={self.max_batch_size} delay={self.max_queue_delay_ms:g}ms "
                f"{state}>")

