"""The BatchingServer's threads: lanes that run batches, direct sends, the timeout reaper.

    lane k (replica k % replicas, one per batch slot):
        _next_batch: park until the policy says a batch is due for its replica
        (batchpolicy.py), take it, _run: stack + pad, model.submit(replica=...),
        wait for its own answer, _answer: each caller's rows, settled at once
    caller's thread (an idle server): _send_direct ─▶ the core; the core's reader
        thread runs _direct_done: the slot freed, then the caller answered (a
        request of exactly one traced batch may name an ``into`` Destination: the
        answer is copied out of the response ring straight into it)
    reaper (started by the first deadline): fails the expired with
        RequestTimeoutError (a running batch is not interrupted)

A mixin of BatchingServer over its queues, lock and counters: the thread side of
the server's threads' path.  An event loop that serves the server runs none of
this (batchloop.py).  A worker that dies fails the batches it held with
WorkerDiedError: a model call is not assumed idempotent, so nothing is retried.
"""
from __future__ import annotations

import heapq
import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import Any, List, Optional

import torch

from .batchpolicy import Request, start_future
from .errors import NeuronmpError, RequestTimeoutError
from .pool.answer import Destination, Pending
from .pool.answer import wake as wake_answers
from .session import chunking

__all__ = ["Claimed", "Lanes", "copy_error"]


class Claimed(Pending):
    """A :class:`Pending` that several threads may race to settle, with a running
    state: a blocking caller's request to a BatchingServer served by its threads
    (``infer``), which the lane that ran it, the timeout reaper and ``close`` may
    each try to answer.

    The contract adds to Pending's:

      * the first ``settle``/``set_result``/``set_exception`` wins, atomically (one
        ``list.pop`` under the GIL: no lock per request); a later one raises
        ``InvalidStateError``, as a Future's would;
      * ``set_running_or_notify_cancel`` marks it taken into a batch (True) or, if
        it is already settled (failed meanwhile), raises ``RuntimeError`` as a
        finished Future does; ``running()`` is taken and not settled.

    A Future costs such a request a Condition, its lock rounds and a notify; the
    caller only ever waits in ``result()`` (docs/design.md, "Waiting for answers").
    """

    __slots__ = ("_claim", "_started")

    def __init__(self) -> None:
        # Pending's fields, set here: one call less on every request's path
        self.helper = None
        self.into = None
        self._flag = bytearray(4)
        self._value = self._exc = None
        self.settled = False
        self._claim = [True]
        self._started = False

    def settle(self, value: Any = None, exc: Optional[BaseException] = None) -> None:
        """Store the answer without waking its waiter (see :func:`wake`); the first
        of racing settlers wins."""
        try:
            self._claim.pop()
        except IndexError:
            raise InvalidStateError("the answer is already set") from None
        self._value, self._exc, self.settled = value, exc, True

    def set_running_or_notify_cancel(self) -> bool:
        """Taken into a batch: True (never cancelled); RuntimeError once settled."""
        if self.settled:
            raise RuntimeError("the answer is already set")
        self._started = True
        return True

    def running(self) -> bool:
        return self._started and not self.settled

    def __repr__(self) -> str:
        state = "finished" if self.settled else "running" if self._started else "pending"
        return f"<neuronmp Claimed {state}>"


class Lanes:
    """The threads of a BatchingServer (see the module docstring)."""

    def _make_lanes(self, batches_per_core: int, replicas: int) -> None:
        """The lanes, not started: ``batches_per_core`` per replica (lane k serves
        replica k % replicas); the first request from a thread starts them."""
        self._running: List[List[Request]] = []          # per lane: its batch in flight
        self._lanes: List[threading.Thread] = []
        # a lane waits on a condition of its own, so a wake-up goes to one that can act
        self._lane_cv: List[threading.Condition] = []
        self._parked: dict = {}    # waiting lanes (keys, in order)
        for slot in range(batches_per_core):
            for replica in range(replicas):
                lane = len(self._lanes)
                self._running.append([])
                self._lane_cv.append(threading.Condition(self._lock))
                t = threading.Thread(target=self._lane, args=(lane, replica), daemon=True,
                                     name=f"neuronmp-serve-r{replica}-{slot}")
                self._lanes.append(t)
        self._lanes_started = False

    def _lane(self, lane: int, replica: int) -> None:
        """Lane ``lane`` serves replica ``replica`` (an index into the model's cores)."""
        while True:
            batch = self._next_batch(lane, replica)
            if batch is None:
                return
            self._running[lane] = batch
            try:
                self._run(batch, replica)
            finally:
                # after its callers are answered, unlike a direct send: freed before,
                # the slot let the next batch go before they sent again, and batches
                # shrank, and throughput with them (tools/bench_serve.py)
                self._running[lane] = []
                with self._lock:
                    self._release(replica)

    def _release(self, replica: int, direct: bool = False) -> None:
        """A batch of ``replica`` is answered: its slot is free again (lock held)."""
        self._busy[replica] -= 1
        # a lane releasing its slot looks for its next batch itself; after a direct
        # send, a lane of this core may have been held back by the slot it took
        if self._waiting and direct:
            self._wake(replica)

    def _wake(self, replica: Optional[int] = None) -> None:
        """Wake one waiting lane that can take a batch now (lock held): of a free
        core if there is one (it need not wait for company once the delay is out),
        else of a core with a free slot; only lanes of ``replica`` if given.  Lanes of
        full cores stay asleep: a wake-up they cannot act on was lost work for the
        lane that could (and every lane waking on every arrival made the lanes and
        the callers queue for the lock and the GIL in turn)."""
        chosen = None
        for lane in self._parked:
            c = lane % self._replicas
            busy = self._busy.get(c, 0)
            if (replica is not None and c != replica) or busy >= self._per_replica:
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

    def _next_batch(self, lane: int, replica: int) -> Optional[List[Request]]:
        """Wait until a batch is due for ``replica``, and take it.

        Due when it is full (a busy core queues it behind its running batch), or,
        when ``replica`` has no batch in flight, once its oldest request has waited
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
                if self._waiting and self._busy.get(replica, 0) < self._per_replica:
                    free = not self._busy.get(replica)
                    limit, wait = self._due(free)
                    if limit:
                        batch = self._take(limit, start_future)
                        if self._waiting:      # the rest starts another lane's clock
                            self._wake()
                        if batch:
                            self._busy[replica] = self._busy.get(replica, 0) + 1
                            return batch
                        continue
                    if free:
                        self._sleep_until_due(lane, wait)
                    else:   # until a batch fills up or this core is free again
                        self._park(lane)
                else:
                    self._park(lane)

    def _sleep_until_due(self, lane: int, wait: float) -> None:
        """Wait (lock held) for the oldest request's due time, waking early by the
        usual oversleep: a timed wait returns late by the scheduler's latency, and the
        delay is a bound on the time a request is held."""
        target = time.monotonic() + wait
        if not self._park(lane, max(0.0, wait - self._slack)):
            late = time.monotonic() - (target - self._slack)
            slack = 0.8 * self._slack + 0.2 * max(0.0, late)
            self._slack = min(slack, self._delay / 2)

    def _run(self, batch: List[Request], replica: int) -> None:
        rows = sum(r.rows for r in batch)
        pad, _ = chunking.plan(rows, self.batch_size, 1)
        try:
            # padded here, in the one stack that assembles the batch: the model's
            # plan then has nothing to pad or strip
            args = [self._assemble(batch, i, pad) for i in range(len(self._signature))]
            t0 = time.monotonic()
            outs = self._model.submit(args, replica=replica, dynamic=True, future=False).result()
            with self._lock:
                self._counts["compute_us"] += (time.monotonic() - t0) * 1e6
            self._answer(batch, outs, rows + pad)
        except BaseException as exc:  # noqa: BLE001 - every caller must hear of it
            self._fail(batch, exc)
            if not isinstance(exc, Exception):
                raise

    def _send_direct(self, req: Request, replica: int, into: Optional[Destination]) -> None:
        """Send a one-request batch to ``replica`` from the caller's thread; the core's
        answer is handled by whichever thread reads it (the core's reader), and
        written into ``into`` if the batch is the request's rows alone."""
        rows = req.rows
        pad, _ = chunking.plan(rows, self.batch_size, 1)
        req.sender = threading.get_ident()
        try:
            args = [self._assemble([req], i, pad) for i in range(len(self._signature))]
            t0 = time.monotonic()
            answer = self._model.submit(args, replica=replica, dynamic=True,
                                        into=None if pad else into)
        except BaseException as exc:  # noqa: BLE001 - the caller hears of it by its future
            self._direct_done(req, replica, 0.0, rows + pad, None, exc)
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            req.sender = 0
        answer.add_done_callback(
            lambda a: self._direct_done(req, replica, t0, rows + pad, a, None))

    def _direct_done(self, req: Request, replica: int, t0: float, total: int,
                     answer: Optional[Future], exc: Optional[BaseException]) -> None:
        """Free the core's slot, then answer (or fail) the request: the slot first, so
        a caller that sends its next request the moment it is answered finds the
        server idle again."""
        with self._lock:
            if t0:
                self._counts["compute_us"] += (time.monotonic() - t0) * 1e6
            self._direct.discard(req)
            self._release(replica, direct=True)
        try:
            if exc is None:
                exc = answer.exception()   # done: no wait
            if exc is None:
                self._answer([req], answer.result(), total)
                return
        except BaseException as err:  # noqa: BLE001 - e.g. an output of the wrong shape
            exc = err
        self._fail([req], exc)

    def _answer(self, batch: List[Request], outs: List[torch.Tensor], total: int) -> None:
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

    def _fail(self, batch: List[Request], exc: BaseException) -> None:
        with self._lock:
            self._counts["failed"] += len(batch)
        for req in batch:
            try:
                req.future.set_exception(copy_error(exc))
            except InvalidStateError:
                pass

    def _track_deadline(self, req: Request) -> None:
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


def copy_error(exc: BaseException) -> BaseException:
    """A fresh instance per caller, so tracebacks raised in many threads do not mix."""
    if isinstance(exc, NeuronmpError):
        try:
            fn, args = exc.__reduce__()
            return fn(*args)
        except Exception:  # an error that cannot rebuild itself is shared as is
            return exc
    return exc

