"""Device-time pacing and the spin heuristics of a core's channel.

A model with a device-time model (``neuronmp.host.devicetime``) answers at once with
the time its answer is due; the coordinator keeps that answer, read early, until
then, so the caller sees the device's latency and not the CPU's:

    response ring ─▶ read early (due later) ─▶ sleep to (due - margin), spin ─▶ settle
                          ▲                         margin learned from how late
                          │                         this host's timers wake
    answers_read_ahead: a caller waiting for several cores' answers takes the
    others' off their rings before its own falls due
    wakes_deferred: a batch of sends wakes each worker once, at its end

The spin budgets say when a waiting thread may keep its CPU instead of sleeping
on the futex: only while a CPU is spare, never to the cost of the workers.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

from ..shm import _waits
from . import limits

_deferred = threading.local()  # .owed: the workers a batch of sends still has to wake
_reading = threading.local()  # .ahead: this thread waits for several cores' answers
_now_ns, _sleep_until, _flags_set = time.perf_counter_ns, _waits.sleep_until, _waits.flags_set
# a reader waiting for a due answer on CPUs of its own sleeps this much short of the
# due time at first and spins the rest, then learns how late its sleeps wake
_MARGIN_FIRST, _MARGIN_MIN, _MARGIN_MAX = 80_000, 5_000, 500_000  # ns
# a thread waiting for several cores' answers (answers_read_ahead) reads the other
# cores' arrived answers this long before its own is due, plus a while per answer
# (see _read_others_first)
_AHEAD_NS, _AHEAD_EACH_NS = 300_000, 10_000
# threads spinning for a due answer on CPUs shared with other cores' workers: at most
# one at a time (a caller's own wait; see _deliver_early)
_shared_spinners = [0]


class wakes_deferred:
    """Send a call's requests to device-time cores first, wake their workers after.

    Waking a sleeping worker is a futex system call, tens of microseconds on a VM,
    and the woken worker often takes the sender's CPU: per request, that spread
    DataParallel's 32 sends over a millisecond, and each chunk's modelled time
    starts when it is sent.  Inside this block a request to a device-time model
    is published without the wake-up; each worker is woken once when the block
    ends.  The worker's own start does not matter (its modelled time runs from
    the send), and a worker that is never woken still finds the request within
    its wait's slice.  Requests to other models wake at once, as their answer's
    latency is the worker's.  Nested blocks wake at the outermost end.

    A class rather than a generator: entering and leaving it is on the path of
    every DataParallel call, before its first chunk is sent.
    """

    __slots__ = ("_owed",)

    def __enter__(self) -> None:
        if getattr(_deferred, "owed", None) is not None:
            self._owed = None    # nested: the outermost block wakes
            return
        self._owed = _deferred.owed = []

    def __exit__(self, *exc) -> None:
        owed = self._owed
        if owed is None:
            return
        _deferred.owed = None
        for worker in owed:
            worker.wake()


class answers_read_ahead:
    """Wait for several device-time cores' answers in turn (a DataParallel call's
    chunks) reading ahead: while waiting for one, take the others' arrived answers
    off their rings before it falls due (see ``_CoreWorker._read_others_first``).
    A thread that waits for one answer (a server's lane) does not: it would only
    take over reads from the threads that wait for those, at one more timer
    wake-up each (docs/performance.md, "The batching server", for what that cost the
    2-core BatchingServer)."""

    __slots__ = ("_was",)

    def __enter__(self) -> None:
        self._was = getattr(_reading, "ahead", False)
        _reading.ahead = True

    def __exit__(self, *exc) -> None:
        _reading.ahead = self._was




class Pacing:
    """The pacing side of a core's channel (``channel.CoreChannel``): answers read
    before they are due, and how long a waiter spins."""

    def _spin_budget(self) -> float:
        """How long a waiter may keep its CPU instead of sleeping on the futex.

        A futex wake-up costs tens of microseconds on a VM: worth saving on short
        requests, when this core is the only one used since the last wait and
        some CPU is spare.
        On long requests it is noise, and a spinning waiter slows the workers
        that share its physical core (hyperthreads), so then it sleeps at once.
        """
        others = self.pool._submits - self.submits
        alone, self._others_seen = others == self._others_seen, others
        spin = self.wait_spin
        if not spin or not alone or self.service > limits.SPIN_LONGEST or \
                not self.pool._spare_cpu(self):
            return 0.0
        return spin

    def _read_ahead(self) -> None:
        """Take an answer that has arrived off the ring now, without waiting, if no
        other thread reads here: kept until it is due (see ``_read_others_first``)."""
        if self._early is None and self.pending and not (self.done or self.dead) and \
                self.owner is None and self.rx_lock.acquire(blocking=False):
            try:
                if self._early is None:
                    self._read_one(0)
            finally:
                self.rx_lock.release()

    def _deliver_early(self, wait: Optional[float], waiter: bool = False) -> None:
        """Sleep until the early answer is due (at most ``wait`` seconds; None: all the
        way), then dispatch it.  A later answer of this core is due no sooner, so
        nothing is read past it meanwhile.

        The sleep ends a learned margin early and spins the rest, as a timer wakes
        tens of microseconds late here.  On CPUs shared with other cores' workers
        only a caller waiting for its own answer (``waiter``) spins, one thread at a
        time: the workers have answered long before the due time, while reader
        threads and every lane of a server spinning would take the workers' CPUs."""
        due = self._early[0]
        until = due if wait is None else min(due, _now_ns() + int(wait * 1e9))
        ahead = waiter and until == due and _reading.__dict__.get("ahead")
        if ahead:
            self._read_others_first(due)
        margin = self._margin
        if self.shared_cpus:
            margin = 0 if not waiter or _shared_spinners[0] else margin
            _shared_spinners[0] += bool(margin)   # under the GIL: a count, not a lock
        try:
            late = _sleep_until(until, until - margin)
        finally:
            if self.shared_cpus:
                _shared_spinners[0] -= bool(margin)
        if margin and until == due:
            self._margin = min(max((margin * 7 + late) // 8, _MARGIN_MIN), _MARGIN_MAX)
        if _now_ns() >= due:
            _due, rid, ok, payload = self._early
            self._early = None
            self._dispatch(rid, ok, payload)
            if ahead:
                self._settle_others_due()

    def _settle_others_due(self) -> None:
        """Once a caller's own answer is due: settle the other cores' answers that are
        due by now, in one pass -- those read ahead (``_read_others_first``), their
        waiters woken in one call, and those arrived since, read here
        (``_read_ahead``: dispatched at once when due, else kept until then); a core
        whose ring holds nothing is passed over, as this runs again for each chunk
        its caller then meets before it is due.

        A DataParallel call's chunks are sent together and so fall due together:
        delivered one by one, each chunk's own wait (a look at the ring, a timer)
        would come after the last one's, and the call's end with them."""
        now, settled = _now_ns(), []
        for w in self.pool._workers.values():
            if w is self or not w.pending or w.owner is not None:
                continue
            if w._early is None:
                if not w.resp.pending():
                    continue    # nothing arrived: a look would only raise Empty
                w._read_ahead()
            early = w._early
            if early is None or early[0] > now or not w.rx_lock.acquire(blocking=False):
                continue
            try:
                early = w._early    # again, under the lock
                if early is not None and early[0] <= now and not (w.done or w.dead):
                    w._early = None
                    answer = w._dispatch_quietly(early[1], early[2], early[3])
                    if answer is not None:
                        settled.append(answer._flag)
            finally:
                w.rx_lock.release()
        if settled:
            _flags_set(settled)

    def _read_others_first(self, due: int) -> None:
        """Before a caller's last stretch to its own due answer, take the other cores'
        arrived answers off their rings (``_read_ahead``).

        A DataParallel call's chunks fall due microseconds apart; read only once
        due, each came later than the last, and a chunk read here goes into the
        call's joined output (``answer.Joint``) before it is due.  The read starts
        earlier the more answers there are to read (each is copied out in Python),
        and only while the caller's own answer is not close: it costs one more
        timer wake-up.  Figures: docs/performance.md, "Device-time
        cores".
        """
        if due - _now_ns() < _AHEAD_NS:
            return
        # _early read unlocked: a hint; _read_ahead looks again under the lock
        others = [w for w in self.pool._workers.values()
                  if w is not self and w.pending and w._early is None]
        if others:
            ahead = due - _AHEAD_NS - _AHEAD_EACH_NS * len(others)
            if ahead > _now_ns():
                _sleep_until(ahead, ahead)
            for w in others:
                w._read_ahead()
