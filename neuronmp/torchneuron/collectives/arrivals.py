"""The arrivals of a shared-memory group: tickets, the done counter, the waits.

    arrive    write my call (calls.py) and stamp, publish my line's counter = gen,
              draw a ticket of gen's parity
    the last  the rank that drew gen's last ticket completes the arrival: publishes
              done = gen (at once, or after the work its peers wait for)
    the rest  wait until done >= gen: a bounded spin, then a futex in slices

An arrival's ticket is an atomic fetch-and-add (shm._waits.fetch_add) on a counter
of the arrival's parity: no rank draws a ticket of arrival g + 2 before every rank
drew its ticket of g + 1, so the ticket's place in its parity's count says whether it
is the last of its arrival, even after a rank refused a call (refuse arrives without
waiting; the rank's next arrival first waits for that one to complete, as it writes
the call area a slow peer may not have compared yet).  The rank that draws the
last ticket knows every peer's slot and call are written (the fetch-and-add orders
them), so it alone reads them right away; the
others all wait on one counter, "done", which it then publishes: one wake-up for
every waiter, whatever the number of ranks, where waiting for each peer's counter in
turn could cost one per peer.

A wait is the transport's (shm._waits.wait) with a budget of its own: spin
NEURONMP_COLLECTIVE_SPIN_US (keeping the CPU for the first NEURONMP_IPC_PAUSE_US,
then yielding it), then sleep on a futex in slices; a wait spins only if a spin would
have caught the completion in the rank's previous wait (adaptive spinning: ranks that
are not running together go straight to the futex), judged by the stamp the last
rank writes when it completes the arrival, not by the wait's length: ranks leave a
backward pass or another group's barrier tens of microseconds apart, and a wait that
slept also holds the wake-up's latency, which would keep the spin off for good.
``waits_caught`` and ``waits_slept`` count the waits that a spin caught and those
that slept; ``reduced_last`` the small all_reduces this rank reduced as the last.
Every arrival also announces the rank's call (calls.py), and every rank compares
its peers' with its own before it reads anything they wrote (the last rank before it
reduces; a mismatch still completes the arrival, so every rank raises it).
Between slices the waiter checks every peer's (pid, start) (a last rank may die in
its reduction, after its ticket) and the group's deadline, so a dead rank is a
CollectiveRankDiedError naming it and a missing one a CollectiveTimeoutError. Each
waiter raises its own sleeping flag beside the done counter, so the last rank makes
the wake system call only when a peer really sleeps.
"""
from __future__ import annotations

import contextlib
import os
import struct
import time
from typing import Iterator, List, Optional, Tuple

from ...errors import CollectiveRankDiedError, CollectiveTimeoutError
from ...host import liveness, paths, procid, settings
from ...shm import _waits
from ...shm.segment import sweep
from . import calls
from .calls import CALL_BYTES

LINE = 64             # one cache line per rank: counter, pid, start
OFF_ABORT = 0         # u32: a rank that failed sets it, so the others stop waiting
# The arrivals' two lines: the tickets of the two parities, the counter of completed
# arrivals ("done") with the rank that drew its last ticket and when it completed, a
# sleeping flag shared by groups too large for a flag each, then a flag per waiter.
_TICKETS, _DONE, _WHO, _DONE_STAMP, _SHARED_FLAG, _FLAGS = 0, 16, 24, 32, 40, 64
SYNC_BYTES = 2 * LINE
_OWN_FLAGS = LINE // 4   # groups up to this size get a sleeping flag per waiter
SLICE = 0.05          # seconds between liveness checks while waiting
# Waits spin NEURONMP_COLLECTIVE_SPIN_US with the rings' pause (NEURONMP_IPC_PAUSE_US,
# read from the settings when a group's segment opens).  Not the rings' busy mode
# (no yielding stage): between one job's ranks it measured no better (the guide), and
# the yield often hands the CPU to the very peer waited for.  A wait skips the whole
# spin after one whose completion came later than the spin (_await).
_load, _wait, _fetch_add = _waits.load, _waits.wait, _waits.fetch_add
_publish_any = _waits.publish_any
_now_ns = time.perf_counter_ns


def line(rank: int) -> int:
    """Where rank ``rank``'s line is (its counter, then its pid and start at 16)."""
    return LINE * (rank + 1)


class Arrivals:
    """The arrivals of one rank of a group whose segment (``seg``, mapped as ``mm``)
    holds its lines, the announced calls at ``calls_at[parity][rank]``, the arrival
    stamps at ``stamps_at[parity][rank]`` and the arrivals' lines at ``sync``."""

    def _init_arrivals(self, seg, rank: int, world: int, timeout: float, sync: int,
                       calls_at, stamps_at) -> None:
        self.seg, self._mm, self.rank, self.world = seg, seg.mm, rank, world
        self.timeout = timeout
        self._spin = settings.get("collective_spin")
        self._pause = min(self._spin, settings.get("ipc_pause"))
        self._spin_next = True
        #: waits that a spin caught / that went to sleep (spun or not)
        self.waits_caught = self.waits_slept = 0
        self._gen = 0
        self._refused: Optional[str] = None   # the op of my last arrival, if a refusal
        self._peers: List[Optional[procid.ProcId]] = [None] * world
        self._others = [r for r in range(world) if r != rank]
        self._call = calls.of("init_process_group")   # what my arrivals announce
        self._calls_at, self._stamps_at = calls_at, stamps_at
        self._tickets = (sync + _TICKETS, sync + _TICKETS + 8)
        self._done, self._who, self._done_stamp = sync + _DONE, sync + _WHO, sync + _DONE_STAMP
        self._own_flags = world <= _OWN_FLAGS
        # where I raise my sleeping flag while I wait for an arrival to complete
        self._flag = sync + (_FLAGS + 4 * rank if self._own_flags else _SHARED_FLAG)
        self._flags_at = sync + _FLAGS

    def announce(self, call: bytes) -> None:
        """The call (calls.of) this rank's next arrivals announce, until the next one."""
        self._call = call

    def barrier(self, op: str) -> None:
        """Every rank arrives: publish my counter and my call, wait for the arrival to
        complete (every peer's ticket drawn); a peer that announced another call fails
        every rank alike (calls.mismatch).

        The calls alternate between two areas by the arrival's parity, as the slots
        do by round: a rank writes the area of arrival g + 2 only after its arrival
        g + 1 completed, by when each peer had compared the calls of g."""
        gen, last = self._arrive()
        if not last:
            self._await(gen, op)
        self._compare(gen, op)

    def _compare(self, gen: int, op: str) -> None:
        """Every peer announced my call at arrival ``gen`` (all of them wrote theirs)."""
        mm, call, at = self._mm, self._call, self._calls_at[gen & 1]
        for r in self._others:
            if mm[at[r]:at[r] + CALL_BYTES] != call:
                raise calls.mismatch(op, [mm[a:a + CALL_BYTES] for a in at])

    def refuse(self, call: bytes, op: str) -> None:
        """Arrive announcing ``call`` (calls.refused), without waiting for the peers:
        each raises when it meets it (my next arrival waits for it: see _arrive)."""
        self._call = call
        self._arrive()
        self._refused = op

    def fail(self, gen: int, op: str, exc: BaseException) -> None:
        """As the last rank of arrival ``gen``, before completing it: the work the
        peers wait for failed with ``exc``.  My call becomes a refusal naming it, so
        each peer, comparing the calls once the arrival is complete, raises too
        instead of taking what I did not make as its result."""
        at = self._calls_at[gen & 1][self.rank]
        self._mm[at:at + CALL_BYTES] = _failed(op, exc)

    @contextlib.contextmanager
    def before_arrival(self, op: str, follows: bool = True) -> Iterator[None]:
        """My part of a call's work that my peers wait for at the next arrival (a
        reduction between two barriers): if it raises, I make that arrival announcing
        a refusal that names the error, so each peer raises it there
        (CollectiveMismatchError) instead of waiting for the group's timeout; then
        the error is mine to raise.  ``follows`` False: no arrival of this call
        follows (the peers need nothing more of me), the error is only raised."""
        try:
            yield
        except Exception as exc:
            if follows:
                self._fail_arrival(op, exc)
            raise

    def _fail_arrival(self, op: str, exc: BaseException) -> None:
        """Arrive announcing that my work failed with ``exc``, and wait for the arrival
        to complete: until then a peer may still read or write my memory (a mapped
        tensor) for this call."""
        call, self._call = self._call, _failed(op, exc)
        try:
            gen, last = self._arrive()
            if not last:
                self._await(gen, op)
        finally:
            self._call = call

    def _arrive(self, hold: bool = False) -> Tuple[int, bool]:
        """Write my call, publish my counter and draw my ticket: (the arrival's number,
        whether mine was its last ticket).  The last rank completes the arrival (wakes
        whoever sleeps on it) at once, or with ``hold`` when it calls ``_complete``:
        after it did the work the peers wait for.

        A refusal is the one arrival a rank leaves before it is complete (every other
        returns complete, or raises): the next one waits for it, since it writes the
        call area of the arrival before the refusal, which a slow peer may still be
        about to compare."""
        if self._refused is not None:
            op, self._refused = self._refused, None
            if _load(self._mm, self._done) < self._gen:
                self._await(self._gen, op)
        self._gen += 1
        gen, mm = self._gen, self._mm
        at = self._calls_at[gen & 1][self.rank]
        mm[at:at + CALL_BYTES] = self._call
        struct.pack_into("<q", self.seg.buf, self._stamps_at[gen & 1][self.rank], _now_ns())
        _waits.store(mm, line(self.rank), gen)   # who has come, for a timeout's message
        # tickets alternate by parity: no rank draws one of arrival g + 2 before every
        # rank drew its ticket of g + 1 (after that of g), so a parity's count of
        # tickets is a whole number of arrivals whenever one of g is drawn
        last = (_fetch_add(mm, self._tickets[gen & 1], 1) + 1) % self.world == 0
        if last:
            _waits.store(mm, self._who, self.rank)   # whom the peers wait for now
            if not hold:
                self._complete(gen)
        return gen, last

    def _complete(self, gen: int) -> None:
        """Publish that arrival ``gen`` is complete, waking the ranks that sleep on it."""
        mm = self._mm
        struct.pack_into("<q", self.seg.buf, self._done_stamp, _now_ns())
        if self._own_flags:   # each waiter sleeps behind its own flag: wake if one did
            _publish_any(mm, self._done, gen, self._flags_at, self.world)
        else:                 # they share one flag, and a completion always wakes
            _waits.store(mm, self._done, gen)
            _waits.wake(mm, self._done)

    def _await(self, gen: int, op: str) -> None:
        """Wait until arrival ``gen`` is complete: spin, then sleep on the done counter
        (one wake-up for every waiter, however many peers came after it)."""
        mm, off, flag = self._mm, self._done, self._flag
        v = _load(mm, off)
        if v >= gen:
            return
        # spin only while a spin would have caught the completion last time: when the
        # ranks are not scheduled together, spinning and yielding costs the waiter's
        # CPU (often the peer's) and then it sleeps anyway
        spin = self._spin if self._spin_next else 0.0
        t0 = _now_ns()
        v = _wait(mm, off, v, flag, OFF_ABORT, spin, SLICE, min(spin, self._pause))
        if v >= gen and _now_ns() - t0 <= spin * 1e9:
            self.waits_caught += 1
            self._spin_next = True
            return
        self.waits_slept += 1   # counted before the checks below, which may raise
        deadline = time.monotonic() + self.timeout
        while v < gen:
            self._check(deadline, op)
            v = _wait(mm, off, v, flag, OFF_ABORT, 0.0, SLICE, 0.0)
        # how late the completion came, by its own stamp: this wait's length also holds
        # the wake-up's latency, which would keep the spin off for good once it exceeds it
        late = struct.unpack_from("<q", self.seg.buf, self._done_stamp)[0] - t0
        self._spin_next = late <= self._spin * 1e9

    def _await_count(self, off: int, flag: int, target: int, op: str, missing) -> None:
        """Wait until the counter at ``off`` reaches ``target`` (the peers' part of a
        call's work, counted as it is done): spin, then sleep behind ``flag`` in
        slices; the liveness checks run whenever a slice passed with no count, and a
        timeout names the ranks ``missing()`` gives."""
        mm = self._mm
        v = _load(mm, off)
        if v >= target:
            return
        spin_end = _now_ns() + int(self._spin * 1e9)
        deadline = None
        while v < target:
            left = max(0.0, (spin_end - _now_ns()) / 1e9)
            seen = v
            v = _wait(mm, off, v, flag, OFF_ABORT, left, SLICE, min(left, self._pause))
            if v == seen:   # a slice with no count (or a rank failed): are all alive?
                if deadline is None:
                    self.waits_slept += 1
                    deadline = time.monotonic() + self.timeout
                self._check(deadline, op, missing)
        if deadline is None:
            if _now_ns() <= spin_end:
                self.waits_caught += 1
            else:
                self.waits_slept += 1

    def _check(self, deadline: float, op: str, missing=None) -> None:
        """Raise if a peer died (even one that drew its ticket: the last rank may die
        in its reduction) or another rank failed, or the group's timeout passed
        (naming the ranks ``missing()`` gives, by default those not arrived)."""
        dead = self._first_dead()
        if dead is not None:
            self._abort()
            sweep_dead(self._peers[dead])
            raise CollectiveRankDiedError(dead, self._peers[dead].pid, op)
        if _waits.load(self._mm, OFF_ABORT) & 0xFFFFFFFF:
            dead = self._first_dead()
            if dead is not None:
                raise CollectiveRankDiedError(dead, self._peers[dead].pid, op)
        if time.monotonic() >= deadline:
            raise CollectiveTimeoutError(op, (missing or self._missing)(), self.timeout)

    def _abort(self) -> None:
        _waits.store(self._mm, OFF_ABORT, 1)
        _waits.wake(self._mm, self._done)

    def _first_dead(self) -> Optional[int]:
        for r, p in enumerate(self._peers):
            if r != self.rank and p is not None and not p.alive():
                return r
        return None

    def _missing(self) -> List[int]:
        """The ranks that have not come, or, when all came, the last one (still at the
        work its peers wait for)."""
        late = [r for r in range(self.world)
                if r != self.rank and _waits.load(self._mm, line(r)) < self._gen]
        return late or [_load(self._mm, self._who)]


def _failed(op: str, exc: BaseException) -> bytes:
    """The refusal a rank announces when its part of call ``op`` raised ``exc``."""
    name = op if op in calls.NAMES else "all_reduce"
    return calls.refused(name, f"its reduction failed: {type(exc).__name__}: {exc}")


def sweep_dead(peer: procid.ProcId, patience: float = 2.0) -> None:
    """Remove what the dead rank left in the runtime directory.  Its main thread shows
    as a zombie while its other threads still exit and hold its liveness lock, and a
    sweep skips an owner whose lock is held: so sweep again, for a bounded time, until
    none of its files is left."""
    deadline = time.monotonic() + patience
    mine = liveness.prefix(peer)
    while True:
        sweep()
        try:
            left = any(n.startswith(mine) for n in os.listdir(paths.subdir("shm")))
        except OSError:
            return
        if not left or time.monotonic() >= deadline:
            return
        time.sleep(0.005)
