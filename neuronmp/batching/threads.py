"""The threads' path: the batches of a BatchingServer's callers that block or hold a
Future (``infer``, ``submit``), formed by whichever thread finds one due.

    caller's thread: submit ─▶ ThreadDriver.submit ─▶ BatchQueue (queue.py)
        an idle server: the request goes straight to a core from its caller
        a batch due now (full, or a free core): formed and sent from the caller
        due later (the delay): the clock is set ─────────────┐
    core's answer ─▶ _done, in the thread that read it       │
        (the core's reader; a loop that owns the core):      │
        each caller's rows settled (not woken yet); one round│
        of the lock: the callers counted as awaited back     │
        (queue.answered), the slot freed, the next due batch │
        taken; that batch sent; then the callers woken at    │
        once.  A partial batch waits for the answered to call│
        again: the last of them back sends it                │
    clock thread (started by the first timed wait) ◀─────────┘
        forms a batch whose delay is out; fails the expired (RequestTimeoutError;
        a running batch is not interrupted, its late answer dropped)

No thread waits for a core: a batch goes through the model's ``Route.send`` with a
callback, the road an event loop's batches take too (loop.py).  So a request costs
no hand-off to a serving thread: its caller, or the thread that answered the batch
before, sends it.  Nor is there a hand-off that gives the callers just answered
time to call again before the next batch is formed, as a serving thread's wake-up
did; so the queue waits for them by count (a partial batch is held until they are
back, it fills, or the delay from the answer is out), where an event loop's path
waits by running their continuations first.  A worker that dies fails the batches it held with
WorkerDiedError: a model call is not assumed idempotent, so nothing is retried.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from concurrent.futures import InvalidStateError
from typing import Any, Dict, List, Optional, Tuple

from ..errors import NeuronmpError, RequestTimeoutError, ServerClosedError
from ..pool.answer import Pending
from ..pool.answer import wake as wake_answers
from ..session.model import Route
from .queue import BatchQueue, CoreSlots, Request, start_future

__all__ = ["Claimed", "ThreadDriver", "copy_error"]


class Claimed(Pending):
    """A :class:`Pending` that several threads may race to settle, with a running
    state: a blocking caller's request to a BatchingServer served by its threads
    (``infer``), which the thread that read its answer, the clock and ``close`` may
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


class ThreadDriver:
    """The threads' path of one server (see the module): its queue, its clock."""

    name = "threads"

    def __init__(self, rows, rules, slots: CoreSlots, model):
        self.rows = rows
        self.queue = BatchQueue(rules, slots)
        self.slots = slots
        self._route = Route(model)
        self._lock = self.queue.lock
        self._idle = threading.Condition(self._lock)   # close waits here
        self._running: Dict[int, List[Request]] = {}   # key -> its batch, sent
        self._sending: Dict[int, int] = {}   # key -> the thread sending it, while it does
        self._keys = itertools.count()
        self._clock: Optional[threading.Thread] = None
        self._clock_cv = threading.Condition(self._lock)
        self._due_at: Optional[float] = None     # a partial batch's due time
        self._deadlines: List[Tuple[float, int, Request]] = []
        self._slack = 0.0                        # typical oversleep of a timed wait
        self.closed = False

    # -- requests -----------------------------------------------------------------

    def submit(self, req: Request, policy) -> None:
        """Queue ``req`` (or send it, an idle server's); raises in the caller for a
        full queue or a closed server."""
        queue = self.queue
        direct = None
        with self._lock:
            if self.closed:
                raise ServerClosedError("the BatchingServer is closed; no new requests")
            queue.admit(req, policy)
            back = queue.returning and queue.arrive()   # the last awaited: act now
            replica = self.slots.claim_idle() if queue.direct_ok() else None
            if replica is not None:   # straight to a core: its slot taken under our lock
                req.queued = False
                queue.counts["direct"] += 1
                queue.count_batch([req], req.rows, time.monotonic(), req.arrival)
                req.future.set_running_or_notify_cancel()   # fresh: not cancelled yet
                direct = self._register([req], replica)
                sends = ()
            else:
                sends = self._due_batches() if queue.add(req) or back else ()
            if req.deadline is not None:
                self._track_deadline(req)
        if direct is not None:
            self._send([req], replica, direct)
        for batch, replica, key in sends:
            self._send(batch, replica, key)

    def poke(self) -> None:
        """A slot another path held is free: send what is due now."""
        with self._lock:
            sends = self._due_batches() if not self.closed else ()
        for batch, replica, key in sends:
            self._send(batch, replica, key)

    # -- batches ------------------------------------------------------------------

    def _due_batches(self) -> list:
        """Take every batch due now for a core with a free slot (lock held); a partial
        batch that waits for its delay on a free core sets the clock."""
        sends, queue, slots = [], self.queue, self.slots
        while queue.waiting:
            replica = slots.free_replica()
            if replica is None:
                break   # an answer frees a slot and looks again
            free = not slots.busy[replica]
            limit, wait = queue.due(free)
            if not limit:
                if free:
                    self._set_clock(time.monotonic() + wait)
                break
            if not slots.claim(replica):
                continue
            batch = queue.take(limit, start_future)
            if not batch:
                slots.release(replica, self)
                continue
            sends.append((batch, replica, self._register(batch, replica)))
        return sends

    def _register(self, batch: List[Request], replica: int) -> int:
        key = next(self._keys)
        self._running[key] = batch
        self._sending[key] = threading.get_ident()
        return key

    def _send(self, batch: List[Request], replica: int, key: int) -> None:
        t0 = time.monotonic()
        try:
            args, total, count, into = self.rows.payload(batch)
            self._route.send(args, count, replica, lambda ok, value, _on_loop: self._done(
                batch, replica, key, t0, total, ok, value), into)
        except BaseException as exc:  # noqa: BLE001 - every caller must hear of it
            self._done(batch, replica, key, 0.0, 0, False, exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._sending.pop(key, None)

    def _done(self, batch: List[Request], replica: int, key: int, t0: float, total: int,
              ok: bool, value: Any) -> None:
        """A batch's answer, in the thread that read it: its callers settled, one
        round of the lock (counted as awaited back, the slot freed, the next due
        batch taken), that batch sent, and only then the callers woken.

        Every time this thread lets the GIL go (a torch op, a futex wake, a lock it
        waits for) it must win the GIL back from the threads that want it, and the
        core idles until the next batch is sent.  Callers just woken are a crowd
        that wants it: woken last, they queue behind the send, not before it.  The
        next batch does not go before they are back unless it is full
        (``queue.answered``), so it shrinks none."""
        settled = []
        if ok:
            try:
                settled = self._settle(batch, self.rows.values(batch, value, total))
            except BaseException as exc:  # noqa: BLE001 - e.g. an output of the wrong shape
                ok, value = False, exc
        with self._lock:
            now = time.monotonic()
            counts = self.queue.counts
            if t0:
                counts["compute_us"] += (now - t0) * 1e6
            # before any of them is woken: each counts back in as it calls again
            self.queue.answered(len(batch), now)
            counts["completed" if ok else "failed"] += len(settled) if ok else len(batch)
            self.slots.free(replica)
            sends = self._due_batches() if self.queue.waiting and not self.closed else ()
        for batch_, other, k in sends:
            self._send(batch_, other, k)
        if ok:
            wake_answers(settled)
        else:
            self._fail(batch, value)
        # running until its callers are settled, so close() never returns before them
        with self._lock:
            self._running.pop(key, None)
            if not self._running:
                self._idle.notify_all()
        self.slots.poke_others(self)

    def _settle(self, batch: List[Request], values: list) -> list:
        """Store each caller's answer, not yet woken; those that timed out meanwhile
        are counted as that, not as done."""
        settled = []
        for req, value in zip(batch, values):
            try:
                req.future.settle(value)
                settled.append(req.future)
            except InvalidStateError:
                pass
        return settled

    def _fail(self, batch: List[Request], exc: BaseException) -> None:
        for req in batch:
            try:
                req.future.set_exception(copy_error(exc))
            except InvalidStateError:
                pass

    # -- the clock: delays and deadlines ---------------------------------------------

    def _set_clock(self, when: float) -> None:
        """Form the queue's partial batch at ``when`` (lock held), unless it is set
        sooner already."""
        if self._due_at is not None and self._due_at <= when:
            return
        self._due_at = when
        self._wake_clock()

    def _track_deadline(self, req: Request) -> None:
        """Remember a deadline (lock held); wake the clock when it comes first."""
        heapq.heappush(self._deadlines, (req.deadline, next(self._keys), req))
        if self._deadlines[0][2] is req:
            self._wake_clock()

    def _wake_clock(self) -> None:
        if self._clock is None:
            self._clock = threading.Thread(target=self._tick, daemon=True,
                                           name="neuronmp-serve-clock")
            self._clock.start()
        else:
            self._clock_cv.notify()

    def _tick(self) -> None:
        while True:
            with self._lock:
                if self.closed:
                    return
                now = time.monotonic()
                expired = self._expired(now)
                sends = []
                if self._due_at is not None and self._due_at - self._slack <= now:
                    late = now - self._due_at
                    self._slack = min(0.8 * self._slack + 0.2 * max(0.0, late),
                                      self.queue.rules.delay / 2)
                    self._due_at = None
                    sends = self._due_batches()
                if not expired and not sends:
                    self._clock_cv.wait(self._next_tick(now))
                    continue
            for req in expired:  # outside the lock: callbacks may call submit()
                stage = "running" if req.future.running() else "waiting in the queue"
                try:
                    req.future.set_exception(RequestTimeoutError(req.timeout, stage))
                except InvalidStateError:
                    pass
            for batch, replica, key in sends:
                self._send(batch, replica, key)

    def _expired(self, now: float) -> List[Request]:
        """The requests whose deadline passed, out of the queue (lock held)."""
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, req = heapq.heappop(self._deadlines)
            if req.future.done():
                continue
            self.queue.remove(req)
            expired.append(req)
        self.queue.counts["timed_out"] += len(expired)
        return expired

    def _next_tick(self, now: float) -> Optional[float]:
        """Seconds to the clock's next duty (a due time, woken early by the usual
        oversleep, or a deadline); None: nothing timed."""
        times = []
        if self._due_at is not None:
            times.append(self._due_at - self._slack)
        if self._deadlines:
            times.append(self._deadlines[0][0])
        return max(0.0, min(times) - now) if times else None

    # -- life -----------------------------------------------------------------------

    def close(self, deadline: float, stuck: BaseException) -> None:
        """Fail the waiting (ServerClosedError), let running batches finish until
        ``deadline`` (time.monotonic), fail those still running with ``stuck``,
        stop the clock."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            waiting = self.queue.drain()
            self._clock_cv.notify_all()
        err = ServerClosedError("the BatchingServer was closed before this request ran")
        for req in waiting:
            try:
                req.future.set_exception(copy_error(err))
            except InvalidStateError:
                pass
        me = threading.get_ident()
        with self._lock:
            # a batch this very thread is sending (a signal handler that closes the
            # server interrupted its send) cannot finish while we wait for it
            while any(self._sending.get(key) != me for key in self._running):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._idle.wait(left)
            still = [req for batch in self._running.values() for req in batch]
        clock = self._clock
        if clock is not None and clock.ident != threading.get_ident():
            clock.join(max(0.0, deadline - time.monotonic()))
        for req in still:
            try:
                req.future.set_exception(copy_error(stuck))
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
