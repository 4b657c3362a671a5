"""An event loop that owns a core: it sends, reads the answers and settles them itself.

    event loop thread                                          worker process
    channel.send(mid, payload, answer) ─ non-blocking put ──▶ request ring ─▶ runs it
      ring full: kept, in order, in the backlog; the                          │
      request ring's fdwait flag up (the worker writes the                    ▼
      fd once it frees room)                               response ring ◀─ answer
    loop.add_reader(core.ready_fd) ◀──── eventfd write, only if a fdwait flag is up
      _ready: drain the response ring (rx_lock, never waited for)
        an answer due later (device time): kept early; the channel's timerfd,
        also registered with the loop, fires at its due time (asyncio's own
        timers round to the millisecond)
        else: answer.set_result / set_exception -> the owner's callback, here
      nothing early: the response ring's fdwait flag up, the head read again

While an event loop owns a core (``_CoreWorker.owner``) the synchronous path
leaves its ring alone: a thread waiting for its own answer on that core (a warm-up,
a DataParallel call) sleeps on its answer's flag and the loop settles it.  Worker
death stays the supervisor's: it fails or re-sends what the dead worker had, then
``kick``s the channel, whose flag was raised on the dead worker's rings.  A loop
that is closed while it owns a core is noticed by the supervisor (or by the next
caller): ``orphan`` hands the ring back to the pool's reader thread and every
``LoopAnswer`` that then arrives runs its callback in that thread, told that its
loop is gone.
"""
from __future__ import annotations

import asyncio
import ctypes
import os
import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Optional, Tuple

from ..errors import PeerDiedError, PoolClosedError, ServerClosedError
from ..shm import _waits
from . import protocol as P

__all__ = ["LoopAnswer", "LoopChannel", "Timer", "channel_for"]

_now_ns, _sleep_until = time.perf_counter_ns, _waits.sleep_until
# a timerfd wakes the loop late by the kernel's slack and the loop's own latency: it
# is set this much early (learned per channel) and the rest is spun, as a caller
# waiting for its own device-time answer does
_MARGIN_FIRST, _MARGIN_MIN, _MARGIN_MAX = 60_000, 5_000, 300_000  # ns
_RETRY = 0.002   # seconds: a send or read that found the core's locks taken tries again


class LoopAnswer:
    """The answer of one request sent by an event loop: no Future, no lock, no flag.

    ``callback(ok, value, on_loop)`` runs once, on the loop's thread when the
    answer is read there (the usual case), or handed to it when another thread
    settles it (the supervisor failing a dead worker's requests); ``on_loop`` is
    False only when the loop is closed, and the callback then runs in the thread
    that settled it.  Duck-typed as the pool's ``Answer`` where the pool keeps it.
    """

    __slots__ = ("into", "_callback", "_loop", "_thread", "_settled")

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: int,
                 callback: Callable[[bool, Any, bool], None], into=None):
        self.into = into
        self._callback = callback
        self._loop = loop
        self._thread = thread
        self._settled = False

    def set_result(self, value: Any) -> None:
        self._finish(True, value)

    def set_exception(self, exc: BaseException) -> None:
        self._finish(False, exc)

    def _finish(self, ok: bool, value: Any) -> None:
        if threading.get_ident() == self._thread:
            self._run(ok, value)
            return
        try:
            self._loop.call_soon_threadsafe(self._run, ok, value)
        except RuntimeError:   # the loop is closed: nobody there hears of it
            self._run(ok, value, False)

    def _run(self, ok: bool, value: Any, on_loop: bool = True) -> None:
        if self._settled:
            return
        self._settled = True
        self._callback(ok, value, on_loop)


class Timer:
    """A timerfd registered with an event loop: ``at(ns)`` runs ``callback`` at that
    ``time.perf_counter_ns`` time (CLOCK_MONOTONIC), to the microsecond."""

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]):
        self.fd = _libc().timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if self.fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_create: {os.strerror(err)}")
        self._loop = loop
        self._callback = callback
        self.armed = 0
        loop.remove_reader(self.fd)   # see LoopChannel: a stale entry of the same number
        loop.add_reader(self.fd, self._fired)

    def at(self, when_ns: int) -> None:
        """Fire at ``when_ns`` (replacing any earlier setting); at once if past."""
        when_ns = max(when_ns, 1)
        self.armed = when_ns
        spec = _ITimerSpec(0, 0, when_ns // 1_000_000_000, when_ns % 1_000_000_000)
        _libc().timerfd_settime(self.fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None)

    def _fired(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:   # disarmed or re-armed meanwhile
            return
        self.armed = 0
        self._callback()

    def close(self, loop_alive: bool = True) -> None:
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        if loop_alive and not self._loop.is_closed():
            self._loop.remove_reader(fd)
        os.close(fd)


class LoopChannel:
    """One core (a pool's ``_CoreWorker``) owned by one event loop; see the module."""

    def __init__(self, worker, loop: asyncio.AbstractEventLoop):
        self.worker = worker
        self.loop = loop
        self.thread = threading.get_ident()
        self.users = 0            # servers of this loop that send here
        self.full_waits = 0       # sends that found the request ring full
        self.watchers: list = []  # called (in any thread) once the channel is orphaned
        self._early: Deque[Tuple[int, Any, bool, Any]] = deque()  # (due, answer, ok, payload)
        self._backlog: Deque[Tuple[int, Any, Any]] = deque()     # (mid, payload, answer)
        self._margin = _MARGIN_FIRST
        self._retry: Optional[asyncio.Handle] = None
        self._closed = False
        self._timer = Timer(loop, self._due)
        self._fd = worker.ready_fd
        # a stale entry of a closed fd of the same number (a pool shut down from
        # another thread) would turn add_reader into a no-op modify
        loop.remove_reader(self._fd)
        loop.add_reader(self._fd, self._ready)
        worker.owner = self
        self._drain()   # anything read by the synchronous path before we took over

    # -- sending ------------------------------------------------------------------

    def send(self, mid: int, payload: Any, answer: LoopAnswer) -> None:
        """Put a RUN request in the core's ring without blocking; a full ring keeps it
        (and those after it) until the worker frees room.  Raises PoolClosedError or
        WorkerDiedError (a core given up) as the pool's send does."""
        if self._backlog or not _try_send(self.worker, mid, payload, answer):
            self._backlog.append((mid, payload, answer))
            self.full_waits += 1
            self._flush()

    def _flush(self) -> None:
        """Send what waits, in order.  At a full ring: raise the request ring's fdwait
        flag and try once more (the worker may have freed room before it saw the
        flag), then wait for the fd.  A retry timer covers a send that failed only
        because another thread held the core's send lock."""
        backlog, worker = self._backlog, self.worker
        armed = False
        while backlog:
            mid, payload, answer = backlog[0]
            try:
                sent = _try_send(worker, mid, payload, answer)
            except Exception as exc:  # noqa: BLE001 - its owner hears of it
                answer.set_exception(exc)
                sent = True
            if sent:
                backlog.popleft()
                continue
            if armed:
                self._retry_soon()
                return
            req = worker.req
            if req is not None and not req.closed:
                req.arm_fd()
            armed = True

    def _retry_soon(self) -> None:
        if self._retry is None and not self._closed:
            self._retry = self.loop.call_later(_RETRY, self._retried)

    def _retried(self) -> None:
        self._retry = None
        self._ready()

    # -- reading --------------------------------------------------------------------

    def _ready(self) -> None:
        """The readiness fd fired (or a kick): send what waited, read what came."""
        try:
            os.read(self._fd, 8)
        except (BlockingIOError, OSError):
            pass
        if self._closed:
            return
        if self._backlog:
            self._flush()
        if not self._early:
            self._drain()

    def _drain(self) -> None:
        """Read every answer in the response ring; settle the due ones, keep the rest."""
        worker = self.worker
        if self._closed or worker.dead or worker.done or worker.owner is not self:
            return
        if not worker.rx_lock.acquire(blocking=False):
            self._retry_soon()   # a replacement, or a reader about to notice us
            return
        now_due = []
        try:
            if worker.dead or worker.done:
                return
            self._read(worker, now_due)
        finally:
            worker.rx_lock.release()
        for answer, ok, payload in now_due:
            worker._settle(answer, ok, payload)
        if self._early:
            self._arm_timer()

    def _read(self, worker, now_due: list) -> None:
        resp, pending, early = worker.resp, worker.pending, self._early
        if worker._early is not None:   # the synchronous path's, read before we owned it
            due, rid, ok, payload = worker._early
            worker._early = None
            entry = pending.pop(rid, None)
            if entry is not None:
                early.append((due, entry[0], ok, payload))
        while True:
            resp.disarm_fd()
            now = _now_ns()
            while True:
                try:
                    if worker._into:
                        rid, ok, payload, due = resp.recv_picked(worker._fill, timeout=0)
                    else:
                        rid, ok, payload, due = resp.recv(timeout=0)
                except queue.Empty:
                    break
                except PeerDiedError:
                    return   # the supervisor replaces it, then kicks us
                if rid == P.BYE_ID:
                    worker.done = True
                    continue
                entry = pending.pop(rid, None)
                if entry is None:
                    continue
                if early or (due and due > now):
                    early.append((due, entry[0], ok, payload))
                else:
                    now_due.append((entry[0], ok, payload))
            if early:
                return   # the timer reads on once the first early answer is due
            resp.arm_fd()
            if not resp.pending():
                return   # asleep with the flag up: the worker writes the fd

    def _arm_timer(self) -> None:
        due = self._early[0][0]
        if self._timer.armed != due - self._margin:
            self._timer.at(due - self._margin)

    def _due(self) -> None:
        """The timer fired: settle the early answers now due (spinning the last
        stretch to the first), then read on."""
        early = self._early
        if not early or self._closed:
            return
        armed = early[0][0] - self._margin
        late = _now_ns() - armed
        self._margin = min(max((self._margin * 7 + late) // 8, _MARGIN_MIN), _MARGIN_MAX)
        first = early[0][0]
        if first > _now_ns():
            if first - _now_ns() > _MARGIN_MAX:   # woken for something else: wait on
                self._arm_timer()
                return
            _sleep_until(first, 0)
        now = _now_ns()
        worker = self.worker
        while early and early[0][0] <= now:
            _due, answer, ok, payload = early.popleft()
            worker._settle(answer, ok, payload)
        if early:
            self._arm_timer()
        else:
            self._drain()

    # -- life -------------------------------------------------------------------------

    def kick(self) -> None:
        """From any thread: look at the rings again (after a worker's replacement)."""
        try:
            self.loop.call_soon_threadsafe(self._ready)
        except RuntimeError:   # the loop is closed
            pass

    def loop_closed(self) -> bool:
        return self.loop.is_closed()

    @property
    def idle(self) -> bool:
        """No early answer, nothing waiting for room, nothing of ours in flight."""
        return not (self._early or self._backlog) and not any(
            isinstance(e[0], LoopAnswer) for e in list(self.worker.pending.values()))

    def detach(self) -> None:
        """On the loop: give the core back to the synchronous path (nothing in flight)."""
        self._close()

    def orphan(self, close_fd: int = -1) -> None:
        """From any thread, when the loop is closed (or the pool shuts down): the core
        goes back to the pool's reader; early answers are settled now, and requests never
        sent fail.  ``close_fd``: the core's readiness fd, handed over by the pool's
        close, closed once the loop no longer watches it.  Idempotent."""
        if self._closed:
            if close_fd >= 0:
                os.close(close_fd)
            return
        early, self._early = list(self._early), deque()
        backlog, self._backlog = list(self._backlog), deque()
        self._close(close_fd)
        for _due, answer, ok, payload in early:   # computed: only the device time is left
            self.worker._settle(answer, ok, payload)
        err = ServerClosedError("the event loop that sent this request was closed "
                                "before the core had room for it")
        for _mid, _payload, answer in backlog:
            answer.set_exception(err)
        for watcher in self.watchers:
            watcher()

    def _close(self, close_fd: int = -1) -> None:
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        # the fds leave the loop's selector on the loop's thread, and only then close:
        # closed first, their numbers could be reused by a socket the loop would then
        # never watch (asyncio would take its add_reader for a modify of ours)
        if self.thread == threading.get_ident() or self.loop.is_closed():
            self._unwatch(close_fd)
        else:
            try:
                self.loop.call_soon_threadsafe(self._unwatch, close_fd)
            except RuntimeError:   # closed meanwhile
                self._unwatch(close_fd)
        worker = self.worker
        if worker.owner is self:
            worker.owner = None
            for ring in (worker.req, worker.resp):
                if ring is not None and not ring.closed:
                    ring.disarm_fd()
            worker.work.set()   # the reader thread takes over what is in flight

    def _unwatch(self, close_fd: int) -> None:
        alive = not self.loop.is_closed()
        if alive:
            self.loop.remove_reader(self._fd)
        self._timer.close(alive)
        if close_fd >= 0:
            os.close(close_fd)

    @property
    def closed(self) -> bool:
        return self._closed


def _try_send(worker, mid: int, payload: Any, answer: LoopAnswer) -> bool:
    """Send a RUN without blocking: False when the request ring is full or another
    thread holds the core's send lock (a replacement: nothing sent); else as the
    pool's send (PoolClosedError, WorkerDiedError for a core given up)."""
    if not worker.lock.acquire(blocking=False):
        return False
    try:
        if worker.stopping:
            raise PoolClosedError()
        if worker.done:
            raise worker._death()
        worker._send_locked(P.RUN, mid, payload, answer, timeout=0.0)
        return True
    except queue.Full:
        return False
    finally:
        worker.lock.release()


def channel_for(worker, loop: asyncio.AbstractEventLoop) -> Optional[LoopChannel]:
    """The channel of ``loop`` on ``worker``'s core: its own, a new one, or None when
    another loop that still runs owns the core (the caller then uses the pool's
    synchronous path).  On the loop's thread."""
    owner = worker.owner
    if owner is not None:
        if owner.loop is loop and not owner.closed:
            return owner
        if not owner.loop_closed():
            return None
        owner.orphan()
    if worker.done or worker.stopping or worker.ready_fd < 0:
        return None
    return LoopChannel(worker, loop)


# -- timerfd (os.timerfd_* arrive in Python 3.13) --------------------------------------

_CLOCK_MONOTONIC = 1
_TFD_TIMER_ABSTIME = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC


class _ITimerSpec(ctypes.Structure):
    _fields_ = [("interval_s", ctypes.c_long), ("interval_ns", ctypes.c_long),
                ("value_s", ctypes.c_long), ("value_ns", ctypes.c_long)]


_LIBC: list = []


def _libc():
    if not _LIBC:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.timerfd_create.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.timerfd_settime.argtypes = (ctypes.c_int, ctypes.c_int,
                                         ctypes.POINTER(_ITimerSpec), ctypes.c_void_p)
        _LIBC.append(libc)
    return _LIBC[0]
