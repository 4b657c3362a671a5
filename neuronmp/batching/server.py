"""The BatchingServer: its public face, and the composition of its parts.

    callers                          BatchingServer (this module)
    submit / infer (threads) ──▶ check the inputs once (Rows.normalise) ─▶ a path:
    infer_async (event loop L)       threads: ThreadDriver (threads.py)
                                     L:       L's LoopDriver (loop.py), one per loop
                                         each: a BatchQueue (queue.py) ─▶ batches
                                         ─▶ stack + pad (rows.py) ─▶ Route.send ─▶ core
                                     CoreSlots (queue.py): the cores' batch slots,
                                     shared by every path
    each caller's rows of the outputs (Rows.values) ◀─────────────────────────────┘

Each caller takes the path its kind of call needs, whatever came first: a thread
blocks on an answer a core's reader sets, an event loop's callers are batched and
answered on that loop; threads and loops may call one server at once, in any order.
config.py checks the arguments (QueuePolicy, Rules); rowbytes.py takes requests
given as bytes (the HTTP front end's).  This module holds the request checks, the
stats and the life cycle.

The number of replicas is fixed when the server starts (place the model first:
``set_multicore``, ``set_neuron_cores``); which core a replica index means is
asked of the model at every batch, so the server follows a model that is moved
later, or loaded again after a runtime restart.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from concurrent.futures import Future
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch

from ..errors import QueueFullError, RequestTimeoutError, ServerClosedError
from ..host import runtime as _runtime
from ..pool.answer import Answer, Destination
from ..session import model as _model
from .config import (
    QueuePolicy,
    Rules,
    check_default_level,
    check_int,
    check_number,
    check_policies,
    check_preferred,
    check_priority,
    traced_batch,
)
from .loop import LoopDriver
from .queue import CoreSlots, Request
from .rows import Rows
from .threads import Claimed, ThreadDriver

__all__ = ["BatchingServer", "QueuePolicy", "QueueFullError", "RequestTimeoutError",
           "ServerClosedError"]

_DEFAULT: Any = object()   # "use the server's timeout"
_CLOSE_GRACE = 10.0
_COUNTS = ("submitted", "rejected", "batches", "rows", "completed", "failed", "timed_out",
           "direct", "queue_us", "compute_us")


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
    (as in Triton's dynamic batcher, the delay bounds the wait for company, not the wait
    for a core).  Unlike Triton's, an idle server sends at once unless
    ``wait_when_idle`` is set.  On the threads' path the callers a batch has just
    answered are awaited back: a partial batch waits until they have called again,
    it fills, or the delay from that answer is out (docs/guides/serving.md).

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
    batches of a few rows, and each costs a model call (docs/performance.md, "The
    batching server").

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
            # a batch runs in one graph: it is sent whole, as one bucket
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
        self.priority_levels: int = check_int("priority_levels", priority_levels, 0)
        self.default_priority_level: int = check_default_level(
            default_priority_level, self.priority_levels)
        self._policies = check_policies(priority_queue_policy, self.priority_levels,
                                         QueuePolicy(self.max_queue_size, self.timeout))
        if not isinstance(wait_when_idle, bool):
            raise TypeError(f"wait_when_idle must be True or False, got {wait_when_idle!r}")
        self.wait_when_idle: bool = wait_when_idle
        self._rules = Rules(self.max_batch_size, self.max_queue_delay_ms / 1000.0,
                            self.preferred_batch_size, wait_when_idle, self.priority_levels,
                            self.default_priority_level,
                            check_priority(None, self.priority_levels,
                                           self.default_priority_level),
                            tuple(self._policies))
        self._rows = Rows(self._model, self.batch_size, self.max_batch_size)
        if warmup:
            self._warm_up()
        self._slots = CoreSlots(self._model.replicas, batches_per_core)
        self._threads = ThreadDriver(self._rows, self._rules, self._slots, self._model)
        self._slots.paths = [self._threads]
        self._lock = threading.Lock()        # the table of loop drivers
        self._loops: Dict[Any, LoopDriver] = {}
        self._last: Tuple[Any, Optional[LoopDriver]] = (None, None)   # the usual loop
        self._retired: collections.Counter = collections.Counter()   # gone loops' counts
        self._retired_sizes: collections.Counter = collections.Counter()
        self._loops_served = 0
        self._closed = False
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

    def infer(self, *inputs: torch.Tensor, timeout: Any = _DEFAULT,
              priority: Optional[int] = None, into: Optional[Destination] = None) -> Any:
        """Submit and wait for the result (raises the request's error; ``into`` as for
        :meth:`submit`).  Refused (RuntimeError) on an event loop's thread whose loop
        calls this server: it would block the loop that reads its cores."""
        if self._loops:
            driver = self._loops.get(_loop_of_thread(self._loops))
            if driver is not None and driver.usable and driver.loop.is_running():
                raise RuntimeError("BatchingServer.infer() on the event loop that serves "
                                   "the server would block that loop: await infer_async() "
                                   "there")
        return self._enqueue(inputs, timeout, Claimed(), priority, into).future.result()

    def _enqueue(self, inputs: Sequence[torch.Tensor], timeout: Any, future,
                 priority: Optional[int], into: Optional[Destination]) -> Request:
        """Check and queue a thread's request (its future an Answer, or for a blocking
        caller a Claimed: it only waits in ``result()``)."""
        req, policy = self._request(inputs, timeout, future, priority)
        req.into = into
        self._threads.submit(req, policy)
        return req

    def _request(self, inputs: Sequence[torch.Tensor], timeout: Any, future,
                 priority: Optional[int]) -> Tuple[Request, QueuePolicy]:
        """A checked request and its level's policy (raises in the caller)."""
        level = self._level(priority)
        policy = self._policies[level]
        timeout = policy.timeout if timeout is _DEFAULT else (
            None if timeout is None else check_number("timeout", timeout))
        return Request(*self._rows.normalise(inputs), timeout, future, level), policy

    def _level(self, priority: Optional[int]) -> int:
        """The queue index (0 = level 1, the highest) for a request's ``priority``."""
        return check_priority(priority, self.priority_levels, self.default_priority_level)

    async def infer_async(self, *inputs: torch.Tensor, timeout: Any = _DEFAULT,
                          priority: Optional[int] = None,
                          into: Optional[Destination] = None) -> Any:
        """``await server.infer_async(x)``: the same as :meth:`infer`, for asyncio code
        (``into`` as for :meth:`submit`); batched and answered on the running loop."""
        loop = asyncio.get_running_loop()
        last_loop, driver = self._last
        if last_loop is loop and driver.usable and timeout is _DEFAULT and \
                priority is None and into is None:
            waiter = self._loop_request(driver, loop, inputs)
        else:
            waiter = self.loop_future(loop, *inputs, timeout=timeout, priority=priority,
                                      into=into)
        return await waiter   # cancelled: still queued, it is skipped

    def loop_future(self, loop: asyncio.AbstractEventLoop, *inputs: torch.Tensor,
                    timeout: Any = _DEFAULT, priority: Optional[int] = None,
                    into: Optional[Destination] = None) -> asyncio.Future:
        """:meth:`infer_async`'s request as a future of ``loop`` (called on it), for
        callers that answer from a done callback rather than a task (the HTTP front
        end).  Raises as :meth:`submit` does."""
        driver = self._loop_driver(loop)
        if driver is None:
            raise ServerClosedError("the BatchingServer is closed; no new requests")
        waiter = loop.create_future()
        req, policy = self._request(inputs, timeout, waiter, priority)
        req.into = into
        driver.submit(req, policy)
        return waiter

    def _loop_request(self, driver: LoopDriver, loop: asyncio.AbstractEventLoop,
                      inputs: Sequence[torch.Tensor]) -> asyncio.Future:
        """:meth:`loop_future` for the usual call (on the loop ``driver`` serves; the
        default level and timeout, no ``into``): what ``_request`` would compute for
        it is the server's own, fixed at start, so a request costs only its check
        (once per shape) and its queueing (the event loop's CPU per request is what
        bounds the rows it serves)."""
        waiter = loop.create_future()
        x = inputs[0] if len(inputs) == 1 else None
        hit = self._rows.accepted.get((x.shape, x.dtype)) \
            if type(x) is torch.Tensor and x.is_cpu else None   # normalise's, inlined
        if hit is None:
            inputs, rows, single = self._rows.normalise(inputs)
        else:
            rows, single = hit
        level = self._rules.default_index
        policy = self._policies[level]
        driver.submit(Request(inputs, rows, single, policy.timeout, waiter, level), policy)
        return waiter

    def _loop_driver(self, loop: asyncio.AbstractEventLoop) -> Optional[LoopDriver]:
        """The path of ``loop``'s callers (made by its first call; on the loop's
        thread); None once the server is closed."""
        driver = self._loops.get(loop)
        if driver is not None and driver.usable:
            self._last = (loop, driver)
            return driver
        for gone in [d for d in list(self._loops.values()) if not d.usable]:
            gone.orphan()   # loops closed since (this one's too): their cores go back
        with self._lock:
            if self._closed:
                return None
            driver = LoopDriver(self._rows, self._rules, self._slots, self._model, loop,
                                self._forget)
            self._loops[loop] = driver
            self._loops_served += 1
            # copied, not changed in place: releases read the list without a lock
            self._slots.paths = self._slots.paths + [driver]
            self._last = (loop, driver)
        return driver

    def _forget(self, driver: LoopDriver) -> None:
        """A loop's path is gone (its loop closed, or the server): its counts stay."""
        with self._lock:
            if self._loops.get(driver.loop) is not driver:
                return
            del self._loops[driver.loop]
            self._slots.paths = [p for p in self._slots.paths if p is not driver]
            if self._last[1] is driver:
                self._last = (None, None)
            with driver.queue.lock:
                self._retired.update(driver.queue.counts)
                self._retired_sizes.update(driver.queue.sizes)

    # -- life cycle -------------------------------------------------------------

    def close(self, timeout: float = _CLOSE_GRACE) -> None:
        """Fail waiting requests (ServerClosedError), finish running batches, stop threads.

        Idempotent.  Batches still running after ``timeout`` seconds fail too.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            drivers = list(self._loops.values())
        deadline = time.monotonic() + timeout
        stuck = ServerClosedError(
            f"the BatchingServer was closed while this request still ran after {timeout:g} s")
        for driver in drivers:
            driver.close(deadline, stuck)
        self._threads.close(deadline, stuck)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> BatchingServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        """Counters since start: submitted, rejected, batches, rows, completed, failed,
        timed_out, direct (one-request batches sent at once, the server being idle),
        queue_us (summed over requests: submission to batch), compute_us (summed over
        batches: sent to the core until answered), running (batches on the cores now),
        queued (now), queued_by_level (now, level 1 first; one entry without levels),
        batch_sizes ({rows: batches formed of that many rows}), mean rows per batch,
        and by_path: {"threads": ..., "event_loop": ...}, each path's submitted,
        batches and rows (every loop's together), with event_loops, the loops that
        have called the server."""
        with self._lock:
            paths = [self._threads] + list(self._loops.values())
            counts = collections.Counter(self._retired)
            sizes = collections.Counter(self._retired_sizes)
            loops_served = self._loops_served
        by_path = {"threads": collections.Counter(), "event_loop": collections.Counter(counts)}
        by_level = [0] * max(1, self.priority_levels)
        for path in paths:
            q = path.queue
            with q.lock:
                counts.update(q.counts)
                sizes.update(q.sizes)
                by_path[path.name].update(q.counts)
                for k, queue in enumerate(q.queues):
                    by_level[k] += len(queue)
        out = {k: counts.get(k, 0) for k in _COUNTS}
        out["running"] = self._slots.running()
        out["queued"] = sum(by_level)
        out["queued_by_level"] = by_level
        out["batch_sizes"] = dict(sizes)
        out["mean_batch_rows"] = out["rows"] / out["batches"] if out["batches"] else 0.0
        out["by_path"] = {name: {k: c.get(k, 0) for k in ("submitted", "batches", "rows")}
                          for name, c in by_path.items()}
        out["by_path"]["event_loop"]["event_loops"] = loops_served
        return out

    def _warm_up(self) -> None:
        """A zero batch of every size the server will run, on every core: checks the
        outputs and warms the workers.  A bucketed model runs a graph per bucket,
        each loaded and first run on its own: every bucket up to the one that holds
        ``max_batch_size`` is warmed here, so no caller's request pays for it."""
        sizes = self._rows.sizes_run()
        answers = [(rows, self._model.submit([z[:rows] for z in self._rows.padding], replica=k))
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


def _loop_of_thread(loops: Mapping[Any, LoopDriver]) -> Any:
    """The loop of this thread among ``loops`` (the loops that call a server)."""
    me = threading.get_ident()
    for loop, driver in list(loops.items()):
        if driver.thread == me:
            return loop
    return None
