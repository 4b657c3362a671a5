"""A core's channel: its request and response rings, its pending table, and who
reads its answers.

    call(core, mid, args) ─▶ send: Answer (or Pending) in pending[rid]
                               │ request ring ((RUN, rid, mid, args, sent)) ──▶ worker
                               ▼                                                  │
    Answer.result(): the caller reads the response ring ◀─────────────────────────┘
       itself while nobody else does (no thread hand-off); answers nobody
       waits on (callbacks, asyncio) are read by the core's reader thread;
       an answer with a Destination (``call(..., into=)``) is copied from the
       ring straight into its buffers, by whichever thread reads it

An event loop may own a core instead (pool/loopchannel.py): it reads the
response ring itself when the worker writes the core's readiness fd.  The
channel's other sides are mixed in from their own modules: the process
(workerproc.py), the supervisor's recovery (supervisor.py) and device-time
pacing (pacing.py).
"""
from __future__ import annotations

import operator
import os
import queue
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..errors import ModelError, PeerDiedError, PoolClosedError
from ..ipc.ring import Ring
from ..shm import _waits
from . import limits, pacing
from . import protocol as P
from .answer import Answer, Destination, Helper, Joint, Pending
from .pacing import Pacing, _deferred, _now_ns
from .shelf import LoadSpec
from .supervisor import Supervised
from .workerproc import WorkerProcess

_flags_set = _waits.flags_set


class CoreChannel(WorkerProcess, Supervised, Pacing, Helper):
    """The coordinator's side of one core: its process, rings, pending answers.

    Answers are read by whoever holds ``rx_lock``.  A thread that waits for its
    own answer takes the lock and reads the response ring itself, so a
    synchronous call costs no hand-off between threads; answers it meets on
    the way complete their owners.  The reader thread takes over when answers
    were only submitted (callbacks, asyncio, bounded waits).  The supervisor
    alone handles the process's death (``replace``), and takes ``lock`` while
    holding ``rx_lock``, as a reader does when an answer's done-callback sends a
    request (a caller chaining its next call); nobody takes them the other way
    round, and nothing is settled while the supervisor holds both.
    """

    def __init__(self, pool, core: int, slot: int, cpus: Tuple[int, ...]):
        self.pool = pool
        self.core = core
        self.slot = slot
        self.cpus = cpus
        self.shared_cpus = any(pool._cpu_users[cpu] > 1 for cpu in cpus)
        self.models: Dict[int, LoadSpec] = {}  # to load again after a restart
        self.pending: Dict[int, tuple] = {}  # rid -> (answer, op, mid, payload, tries)
        self.lock = threading.Lock()  # one sender at a time; held across a replacement
        self.rx_lock = threading.Lock()  # one reader of the response ring at a time
        self.work = threading.Event()  # the reader thread has answers to serve
        self.proc = None
        self.pidfd: Optional[int] = None
        self.req: Optional[Ring] = None
        self.resp: Optional[Ring] = None
        self.reader: Optional[threading.Thread] = None
        # the core's readiness fd, one for the life of the core (every worker process
        # it starts gets a copy): written by the worker when an event loop that owns
        # the core (``owner``, a loopchannel.LoopChannel) sleeps on it
        self.ready_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.owner = None
        self.stopping = False
        self.dead = False  # the process died; the supervisor has not replaced it yet
        self.done = False  # the worker said goodbye, or died while stopping
        self.service = 0.0  # typical seconds a caller waits for an answer (moving average)
        self._progress = (-1, 0.0)  # (requests done, since when): the supervisor's watch
        self._timed_out = 0  # the request id stopped for running past the exec timeout
        self.submits = 0  # requests sent to this core
        # an answer read before it was due: (due, rid, ok, payload), rx_lock's to touch
        self._early: Optional[tuple] = None
        # requests whose answers go into a Destination: while any is pending, answers
        # are looked at in the ring before they are copied out (``_fill``)
        self._into: set = set()
        # how early a reader wakes for a due answer and spins (learned; see _deliver_early)
        self._margin = pacing._MARGIN_FIRST
        self._others_seen = -1  # requests sent to other cores, at the last wait
        # a caller's spin budget, read once: settings are fixed for the runtime the
        # channel lives in, and a lookup per call costs what a short call's bookkeeping does
        self.wait_spin = limits.wait_spin()
        self._submitted = pool._stats.counter(slot, "submitted")  # this core's, in place
        self._start_process()

    # -- requests -------------------------------------------------------------

    def send(self, op: int, mid: int, payload, into: Optional[Destination] = None,
             future: bool = True) -> Union[Answer, Pending]:
        """Send one request; its Answer, read by its waiter or the reader thread
        (``future=False``: a Pending, for a caller that only waits for it)."""
        answer = Answer(self, running=True) if future else Pending(self)
        if into is not None:
            answer.into = into
        with self.lock:
            if self.stopping:
                raise PoolClosedError()
            if self.done:  # its replacement could not start (_abandon): the core is down
                raise self._death()
            self._send_locked(op, mid, payload, answer)
        return answer

    def _send_locked(self, op: int, mid: int, payload, answer: Optional[Answer] = None,
                     tries: int = 0, timeout: Optional[float] = None) -> Answer:
        # one request per core of a DataParallel call comes here, each delaying the
        # start of the next core's: every step is kept to plain attribute work
        answer = Answer(self, running=True) if answer is None else answer
        pool = self.pool
        rid = next(pool._ids)
        # the request is kept until answered: a worker that dies before reading it
        # gets it again from the supervisor (``replace``)
        self.pending[rid] = (answer, op, mid, payload, tries)
        if answer.into is not None:
            self._into.add(rid)
        self.submits += 1
        pool._submits += 1  # approximate across threads: only a hint for _spin_budget
        self._submitted[0] += 1
        owed = _deferred.__dict__.get("owed")
        later = owed is not None and op == P.RUN and self._timed(mid)
        try:
            self.req.send((op, rid, mid, payload, _now_ns()), timeout, wake=not later)
            if later:
                owed.append(self)
        except PeerDiedError:
            pass  # the supervisor fails it with the others when it replaces the worker
        except BaseException:
            self._forget(rid)
            raise
        return answer

    def _forget(self, rid: int) -> None:
        """Undo a request's bookkeeping when it could not be sent."""
        self.pending.pop(rid, None)
        self._into.discard(rid)
        self._submitted[0] -= 1

    def _timed(self, mid: int) -> bool:
        spec = self.models.get(mid)
        return spec is not None and bool(spec.timing)

    def wake(self) -> None:
        """Wake the worker for requests sent without a wake-up (``wakes_deferred``)."""
        with self.lock:
            if not (self.dead or self.done) and self.req is not None:
                self.req.wake_reader()

    def watch(self, answer: Union[Answer, Pending]) -> None:
        self.work.set()  # a callback needs the reader thread: nobody may wait

    def wait(self, answer: Union[Answer, Pending], timeout: Optional[float]) -> None:
        """An Answer's waiter: read answers in this thread while nobody else does."""
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        self.resp.spin_budget = self._spin_budget()
        while not answer.settled:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return
            if not (self.done or self.dead) and self.owner is None and \
                    self.rx_lock.acquire(blocking=False):
                try:
                    self._read_until(answer, deadline)
                finally:
                    self.rx_lock.release()
            else:  # another thread reads (or the supervisor fails it): it settles ours
                answer._wait_flag(0.002 if remaining is None else min(0.002, remaining))
        self.service = 0.8 * self.service + 0.2 * (time.monotonic() - start)

    def start_load(self, mid: int, spec: LoadSpec) -> Answer:
        """Send the LOAD of model ``mid``; kept to load again after a restart."""
        if spec.weights is not None:
            spec.weights.acquire()
        self.models[mid] = spec
        try:
            return self.send(P.LOAD, mid, spec.payload())
        except BaseException:
            self._forget(mid)
            raise

    def unload(self, mid: int) -> None:
        if mid in self.models:
            try:
                self.send(P.UNLOAD, mid, None, future=False).result()
            finally:
                self._forget(mid)

    def _forget(self, mid: int) -> None:
        spec = self.models.pop(mid, None)
        if spec is not None and spec.weights is not None:
            self.pool._shelf.release(spec.weights)

    # -- answers (only with rx_lock held) --------------------------------------

    def _read_until(self, until: Optional[Answer], deadline: Optional[float] = None,
              slice_: float = 0.05) -> None:
        """Read answers until ``until`` is done (None: nothing pending) or the deadline.

        Short slices: a reader must notice soon that the supervisor settled its
        answer (the worker died) and leave the ring to it.
        """
        while not (self.done or self.dead):
            if until is not None and until.settled:
                return
            if until is None and (not self.pending or self.owner is not None):
                return
            wait = slice_
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    return
            if self._early is not None:
                self._deliver_early(wait, waiter=until is not None)
            elif not self._read_one(wait):
                return  # the supervisor replaces the worker and fails what it had

    def _read_one(self, wait: float) -> bool:
        """Read one answer (waiting at most ``wait`` s): kept as the early answer
        if it is not due yet,
        else dispatched; False if the worker died."""
        try:
            if self._into:
                rid, ok, payload, due = self.resp.recv_picked(self._fill, timeout=wait)
            else:
                rid, ok, payload, due = self.resp.recv(timeout=wait)
        except queue.Empty:
            return True
        except PeerDiedError:
            return False
        if due and due > _now_ns():
            self._early = (due, rid, ok, payload)
        else:
            self._dispatch(rid, ok, payload)
        return True

    def _fill(self, answer: tuple) -> Optional[tuple]:
        """``recv_picked``'s pick: an answer, still in the ring, whose request has a
        Destination goes into it (the answer then holds the buffers); None for any
        other answer (copied out as usual).  Written as soon as it is read, even when
        it is kept until its due time: the owner's guard decides what may be written."""
        rid, ok, payload, due = answer
        if rid not in self._into:
            return None
        self._into.discard(rid)
        entry = self.pending.get(rid)
        if not ok or entry is None or entry[0].into is None:
            return None
        filled = entry[0].into.fill(payload, entry[0])
        return None if filled is None else (rid, ok, filled, due)

    def _dispatch(self, rid: int, ok: bool, payload) -> None:
        answer = self._dispatch_quietly(rid, ok, payload)
        if answer is not None:
            _flags_set((answer._flag,))

    def _dispatch_quietly(self, rid: int, ok: bool, payload) -> Optional[Answer]:
        """Settle the answer of request ``rid`` without waking its waiter; the answer
        whose waiter to wake (``answer.wake``), or None."""
        if rid == P.BYE_ID:
            self.done = True
            return None
        entry = self.pending.pop(rid, None)
        if entry is None:
            return None
        answer = entry[0]
        try:
            if ok:
                answer.settle(payload)
            else:
                answer.settle(None, self._error_of(payload))
        except Exception:  # cancelled or timed out by its owner meanwhile
            return None
        return answer

    def _settle(self, answer: Answer, ok: bool, payload) -> None:
        try:
            if ok:
                answer.set_result(payload)
            else:
                answer.set_exception(self._error_of(payload))
        except Exception:  # cancelled or timed out by its owner meanwhile
            pass

    def _error_of(self, payload) -> BaseException:
        """A failed request's error: a neuronmp error comes as itself, a model's as
        the fields of a ModelError."""
        return payload if isinstance(payload, BaseException) else ModelError(self.core, *payload)

    def _read_loop(self) -> None:
        """Serve answers nobody waits on in ``result``.

        A caller in ``result`` reads for itself; this thread steps in only when
        the ring is free: within a few milliseconds for pending answers, at once
        for answers with callbacks (``add_done_callback`` sets ``work``).
        """
        while not self.done:
            self.work.wait(0.005 if self.pending else 0.25)
            self.work.clear()
            if self.dead or self.owner is not None or not self.rx_lock.acquire(blocking=False):
                continue
            try:
                if not self.done and self.pending:
                    # more cores than CPUs: nobody waits on these answers in this
                    # thread, so it sleeps rather than spins until they come (a reader
                    # thread per core spinning takes CPU from DataParallel's caller)
                    self.resp.spin = not self.shared_cpus
                    try:
                        self._read_until(None, slice_=0.05)
                    finally:
                        self.resp.spin = True
            finally:
                self.rx_lock.release()

    # -- shutdown -------------------------------------------------------------

    def finish(self) -> None:
        """After the process ended: stop the reader, fail what is left, free the rings."""
        self.done = True
        self._close_pidfd()
        self.work.set()
        if self.reader is not None and self.reader is not threading.current_thread():
            self.reader.join(2.0)
        err = PoolClosedError("the neuronmp runtime shut down before this request finished")
        with self.rx_lock:
            if self._early is not None:  # computed: it only waits for its modelled end
                self._deliver_early(None)
            self._fail_pending(err)
            for ring in (self.req, self.resp):
                if ring is not None:
                    ring.close()
        owner, fd = self.owner, self.ready_fd
        self.ready_fd = -1
        if owner is not None:   # what it holds fails now; the fd closes once unwatched
            owner.orphan(close_fd=fd)
        elif fd >= 0:
            os.close(fd)


def send_runs(channels: Sequence[CoreChannel], mids: Sequence[int], payloads: Sequence[tuple],
              into: Optional[Destination] = None) -> List[Pending]:
    """One RUN of model ``mids[k]`` with ``payloads[k]`` on ``channels[k]``, each channel
    once: the Pendings in order (``CoreChannel.send(..., future=False)`` for each).
    A :class:`~neuronmp.pool.answer.Joint` as ``into`` is told the answers
    (``Joint.expect``) before any request is published, so every part is read into it.

    The requests are stamped together and published in one C call, and the
    workers woken once all are (``Ring.put_many``): a device-time DataParallel
    call's chunks each start their modelled time when sent, so sent one by one
    the last waited behind every other's Python (docs/performance.md,
    "Device-time cores").  Every channel's send lock is held meanwhile, taken in
    core order (as every caller of this takes them; nobody holding one waits for
    another).  Raises PoolClosedError, or the death of a core given up, before
    anything is sent; a request that cannot be sent at once (its ring full, a
    frame for codec.py) is sent after the others as ``send`` would."""
    held = []
    try:
        for c in sorted(channels, key=_core_of):  # in core order: see the docstring
            c.lock.acquire()
            held.append(c)
        for c in channels:
            if c.stopping:
                raise PoolClosedError()
            if c.done:  # its replacement could not start (_abandon): the core is down
                raise c._death()
        pool = channels[0].pool
        ids, answers, rids = pool._ids, [], []
        for c, mid, payload in zip(channels, mids, payloads):
            answer = Pending(c)
            answer.into = into
            rid = next(ids)
            # kept until answered, as _send_locked keeps it (a worker that dies
            # before reading it gets it again from the supervisor)
            c.pending[rid] = (answer, P.RUN, mid, payload, 0)
            if into is not None:
                c._into.add(rid)
            c.submits += 1
            c._submitted[0] += 1
            answers.append(answer)
            rids.append(rid)
        pool._submits += len(rids)
        if isinstance(into, Joint):
            into.expect(answers)
        stamp = _now_ns()
        frames = [(P.RUN, rid, mid, payload, stamp)
                  for rid, mid, payload in zip(rids, mids, payloads)]
        rings = [c.req for c in channels]
        for k in range(Ring.put_many(rings, frames), len(frames)):
            try:
                rings[k].send(frames[k])
            except PeerDiedError:
                pass  # the supervisor fails it with the others when it replaces the worker
            except BaseException:
                for c, rid in zip(channels[k:], rids[k:]):
                    c._forget(rid)
                raise
        return answers
    finally:
        for c in held:
            c.lock.release()


_core_of = operator.attrgetter("core")
