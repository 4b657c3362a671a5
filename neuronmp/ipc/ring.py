"""Single-producer single-consumer ring of variable-size frames in one segment.

    segment:  [ header page | data: capacity bytes, used as a circle ............ ]
    header:   head  u64   bytes ever published by the writer (writer stores, release)
              tail  u64   bytes ever released by the reader   (reader stores, release)
              rsleep, wsleep u32   "I am about to futex-sleep" flags of reader / writer
              closed u32, owner and attacher (pid, start)
              fdwait u64  "I wait on my readiness fd" flag of an event loop peer

    writer:  wait until tail leaves room -> write record at head % capacity
             -> publish(head + length): one release store, then wake the reader
                only if its rsleep flag is up
    reader:  wait until head moves -> decode the record in place -> copy, view
             or copy into the caller's tensors (recv_into, recv_picked)
             -> store tail (release), wake the writer only if wsleep is up

For the common frames (see codec.py) the writer's steps after the wait are
one C call (``_frames.put``) and so are the reader's (``_frames.get``): at a few
microseconds per message, Python bookkeeping would otherwise dominate.

A record that would cross the end of the data area is preceded by a PAD record
filling the rest of the circle, so every frame is contiguous and can be viewed
without copying.  A frame bigger than half the ring goes on another segment,
named by a small record in the ring:

    ARENA   one of the writer's two spill arenas, reused for frame after
            frame: the reader maps each once and keeps the mapping; the writer
            writes one again only once the tail has passed the record that
            named it (the reader has copied the frame out, or released its
            views), grows it by making a new one, and unlinks both at close.
            Making, zero-filling and mapping a fresh segment costs several
            times the copy itself (docs/performance.md, "Transport:
            shared-memory rings"), so a sender of large frames pays that
            once, not per frame.  The record says "<slot> <segment name>".
    SPILL   a one-off segment, when both arenas are still in use (frames in
            flight) or the frame is bigger than _ARENA_MAX: the reader unlinks
            it as soon as it has mapped it, and the writer unlinks any the
            reader never took at close.

Nothing is visible to the reader before the head store, so a writer killed
mid-copy leaves no partial frame.  Waits spin for ``NEURONMP_IPC_SPIN_US``
microseconds (the first ``NEURONMP_IPC_PAUSE_US`` without yielding the CPU),
then sleep on a futex in slices of ``_SLICE`` seconds; between
slices the waiter checks that its peer (pid + start time) still lives.
"""
from __future__ import annotations

import os
import queue
import struct
import time
from collections import deque
from typing import Any, Callable, List, Optional, Tuple

from ..errors import PeerDiedError
from ..host import procid, settings
from ..shm import _waits
from ..shm.segment import Segment
from . import _frames, codec

_MAGIC = 0x31474E49524D4E4E  # "NNMRING1"
_HEADER = 4096
_OFF_MAGIC, _OFF_CAPACITY = 0, 8
_OFF_HEAD, _OFF_TAIL = 64, 128
_OFF_RSLEEP, _OFF_WSLEEP = 192, 256
_OFF_CLOSED = 320
_OFF_OWNER, _OFF_ATTACHER = 384, 448  # (pid u64 at +0, start u64 at +8)
# raised by a peer that sleeps in an event loop on a readiness fd (the response
# ring's reader, the request ring's writer); the u32 after it stays zero
_OFF_FDWAIT, _OFF_ZERO = 512, 520
_CLOSED_BY_OWNER, _CLOSED_BY_ATTACHER = 1, 2
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

_SLICE = 0.25  # how often a waiter re-checks its peer's liveness
# A ring's spin and pause come from the settings (NEURONMP_IPC_SPIN_US and
# NEURONMP_IPC_PAUSE_US, parsed once per runtime) when it is made or attached.
# Of the spin, the first part keeps the CPU (see _waits.wait).  That wins when
# the peer runs on the other CPU and answers within microseconds; when it does
# not (it waits for this very CPU on a busy host) the pause is pure loss.  So a
# wait that outlasts the pause, but not the spin (then the peer was just idle),
# puts the waiter in busy mode for the next
# _BUSY_WAITS waits: keep the CPU only _PAUSE_BUSY, then go straight to the
# futex (a woken sleeper gets the CPU back sooner than a yielder, which queues
# behind every CPU hog).  Busy mode always ends: both peers in it would only
# ever see futex-slow answers, and could not tell that the host calmed down.
_PAUSE_BUSY = 2e-6
_BUSY_WAITS = 16


def _tuning() -> tuple:
    """(spin, pause, busy pause) in seconds, from this runtime's settings."""
    spin = settings.get("ipc_spin")
    pause = min(spin, settings.get("ipc_pause"))
    return spin, pause, min(pause, _PAUSE_BUSY)


_now = time.perf_counter
_MIN_CAPACITY = 4096
# Frames up to this size reuse the writer's arena; a bigger one would keep that
# much shared memory for the ring's life, so it travels on a one-off segment.
_ARENA_MAX = 256 << 20
# Arenas per ring: two let a second large frame be sent while the reader still
# holds the first (the batching server keeps two batches per core in flight).
_ARENAS = 2
_MIB = 1 << 20
_load, _store, _publish, _wait = _waits.load, _waits.store, _waits.publish, _waits.wait
# the C codec: one call encodes + publishes a frame, one call finds + decodes it
_put, _get, _copy, _put_many = _frames.put, _frames.get, _frames.copy, _frames.put_many
_Tensor = codec.torch.Tensor
codec.setup_fast_path((_HEADER, _OFF_CAPACITY, _OFF_HEAD, _OFF_TAIL, _OFF_RSLEEP, _OFF_WSLEEP))


class Frame:
    """A received frame whose tensors are views of the ring (no copy).

    The ring space stays reserved until ``release()`` (or the end of a
    ``with`` block); after that the tensors must not be used, because the
    writer reuses the memory.  Take ``.clone()`` of what you keep.
    """

    __slots__ = ("value", "_ring", "_start", "_released")

    def __init__(self, value: Any, ring: Ring, start: int):
        self.value = value
        self._ring = ring
        self._start = start  # ring bytes from here on stay reserved while this lives
        self._released = False

    def release(self) -> None:
        """Give the frame's space back to the writer (idempotent)."""
        if not self._released:
            self._released = True
            self._ring._release_view(self)

    def __enter__(self) -> Frame:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Ring:
    """One direction of a channel: one process sends, the other receives.

    Create on one side (``Ring.create``), pass ``ring.name`` to the peer, which
    calls ``Ring.attach(name)``.  Either side may send or receive, but each
    direction must have a single sending and a single receiving thread at a time.
    """

    def __init__(self, seg: Segment, owner: bool, tuning: Optional[tuple] = None):
        self._seg = seg
        self._buf = seg.buf
        self._owner = owner
        self.name = seg.name
        self.capacity = _U64.unpack_from(seg.buf, _OFF_CAPACITY)[0]
        self._max_inline = self.capacity // 2
        self._peer: Optional[procid.ProcId] = None
        self._closed = False
        self._busy = 0  # waits left in busy mode (see _PAUSE_BUSY)
        self._spin, self._pause, self._pause_busy = tuning or _tuning()
        # seconds a waiter may keep its CPU before sleeping, set by a caller that
        # knows a CPU is spare (the pool): a futex wake-up costs tens of us on a VM
        self.spin_budget = 0.0
        # False: waits go straight to the futex (a reader nobody waits on: spinning
        # there only takes a CPU from the threads and processes that do the work)
        self.spin = True
        # writer side
        self._head = _load(self._buf, _OFF_HEAD)
        self._tail_seen = _load(self._buf, _OFF_TAIL)
        self._spilled: deque = deque()
        # the reused spill segments (see ARENA), and per slot the tail past the
        # record that last named it; the slot of the frame being sent
        self._arenas: List[Optional[Segment]] = [None] * _ARENAS
        self._arena_free_at = [0] * _ARENAS
        # reader side: its mappings of the peer's arenas, by slot
        self._arenas_in: List[Optional[Segment]] = [None] * _ARENAS
        # reader side
        self._read = self._tail_seen  # end of what recv has consumed
        self._views: deque = deque()  # unreleased Frames, oldest first

    # -- life cycle ---------------------------------------------------------

    @classmethod
    def create(cls, capacity: int = 8 << 20, *, populate: bool = True) -> Ring:
        """A new ring with ``capacity`` data bytes (rounded up to a page), owned here.

        ``populate=False`` leaves the pages to be faulted in on the ring's first lap
        instead of mapping them all now (cheaper per page, but paid up front)."""
        if isinstance(capacity, bool) or not isinstance(capacity, int) or \
                capacity < _MIN_CAPACITY:
            raise ValueError(f"Invalid ring capacity {capacity!r}: expected an int of at "
                             f"least {_MIN_CAPACITY} bytes")
        capacity = -(-capacity // _HEADER) * _HEADER
        tuning = _tuning()   # a bad setting fails here, before a segment exists
        seg = Segment.create(_HEADER + capacity, populate=populate)
        _U64.pack_into(seg.buf, _OFF_CAPACITY, capacity)
        _write_ident(seg.buf, _OFF_OWNER, procid.current())
        _store(seg.buf, _OFF_MAGIC, _MAGIC)
        return cls(seg, owner=True, tuning=tuning)

    @classmethod
    def attach(cls, name: str, *, populate: bool = True) -> Ring:
        """Map the ring ``name`` created by another process; that process is the peer."""
        tuning = _tuning()
        seg = Segment.attach(name, populate=populate)
        if seg.size < _HEADER + _MIN_CAPACITY or _load(seg.buf, _OFF_MAGIC) != _MAGIC:
            seg.close()
            raise ValueError(f"Shared-memory segment {name!r} is not a neuronmp ring")
        _write_ident(seg.buf, _OFF_ATTACHER, procid.current())
        # a previous attacher that closed normally does not make this one's peer dead
        if _U32.unpack_from(seg.buf, _OFF_CLOSED)[0] == _CLOSED_BY_ATTACHER:
            _U32.pack_into(seg.buf, _OFF_CLOSED, 0)
        return cls(seg, owner=False, tuning=tuning)

    def set_peer(self, ident: procid.ProcId) -> None:
        """Whose death makes a wait on this ring raise PeerDiedError."""
        if not isinstance(ident, tuple) or len(ident) != 2:
            raise TypeError(f"Invalid peer {ident!r}: expected a neuronmp.host.procid.ProcId")
        self._peer = procid.ProcId(*ident)

    @property
    def peer(self) -> Optional[procid.ProcId]:
        """The peer set with ``set_peer``, else the one recorded in the header."""
        if self._peer is not None:
            return self._peer
        return _read_ident(self._buf, _OFF_ATTACHER if self._owner else _OFF_OWNER)

    def close(self) -> None:
        """Stop using the ring; wakes a waiting peer; the owner unlinks the segment."""
        if self._closed:
            return
        self._closed = True
        buf = self._buf
        _U32.pack_into(buf, _OFF_CLOSED, _CLOSED_BY_OWNER if self._owner else _CLOSED_BY_ATTACHER)
        _waits.wake(buf, _OFF_HEAD)
        _waits.wake(buf, _OFF_TAIL)
        while self._spilled:  # one-off segments the reader never took
            _unlink_quiet(self._spilled.popleft())
        for seg in self._arenas + self._arenas_in:
            if seg is not None:
                seg.close()  # the writer's is unlinked; the reader's is only unmapped
        self._views.clear()
        self._seg.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        side = "owner" if self._owner else "attached"
        return f"Ring({self.name!r}, capacity={self.capacity}, {side})"

    # -- sending ------------------------------------------------------------

    def send(self, obj: Any, timeout: Optional[float] = None, wake: bool = True) -> None:
        """Send a pytree of tensors; block while the ring is full.

        Raises queue.Full if no room appeared within ``timeout`` seconds (the
        frame is then not sent; nothing is ever dropped once send returns),
        PeerDiedError if the reader died.  ``wake=False`` may leave a sleeping
        reader asleep (it still sees the frame within its wait's slice): the
        sender then owes it ``wake_reader()``.
        """
        if self._closed:
            raise ValueError("send on a closed ring")
        buf = self._buf
        mode = 1 if wake else 2
        head = _put(buf, obj, self._head, self._max_inline, mode)
        if head < 0:  # common frame, ring full: wait for room, then it fits
            self._wait_room(-head, timeout)
            head = _put(buf, obj, self._head, self._max_inline, mode)
        if head > 0:
            self._head = head
            return
        p = codec.plan(obj)  # the C codec declined: pickled, prepared or spilled
        slot = -1
        if p.length > self._max_inline:
            p, slot = self._spill(p)
        try:
            self._put(p, timeout)
        except BaseException:
            if p.kind == codec.SPILL:
                _unlink_quiet(self._spilled.pop())
            raise
        if slot >= 0:
            self._arena_free_at[slot] = self._head

    @staticmethod
    def put_many(rings: List[Ring], objs: List[Any]) -> int:
        """Send ``objs[k]`` on ``rings[k]`` (each ring once, its single writer's
        thread) in one C call as far as that goes: the common frames that fit now,
        in order, all published before any reader is woken.  Returns how many were
        sent; the caller sends the rest with ``send`` (which waits for room, spills,
        or raises what stopped this call).

        A message to each of many cores then costs one Python call, not one per
        core: the first core's frame is not sent sooner than the last's by the
        Python between them (what a device-time DataParallel call pays for)."""
        heads = _put_many([None if r._closed else (r._buf, o, r._head, r._max_inline)
                           for r, o in zip(rings, objs)], True)
        sent = 0
        for ring, head in zip(rings, heads):
            if head is None:
                break
            ring._head = head
            sent += 1
        return sent

    def wake_reader(self) -> None:
        """Wake the reader if it sleeps (after sends with ``wake=False``)."""
        if not self._closed:
            _publish(self._buf, _OFF_HEAD, self._head, _OFF_RSLEEP)

    def _free_arena(self) -> int:
        """A slot whose arena the reader is done with (made ones first), or -1."""
        tail = _load(self._buf, _OFF_TAIL)
        free = [i for i in range(_ARENAS) if tail >= self._arena_free_at[i]]
        made = [i for i in free if self._arenas[i] is not None]
        return (made or free or [-1])[0]

    def _spill(self, p: codec.Plan) -> Tuple[codec.Plan, int]:
        """Write ``p`` on an arena the reader is done with, else on a one-off segment:
        the record to put in the ring, and the arena's slot (-1 for a one-off)."""
        slot = self._free_arena() if p.length <= _ARENA_MAX else -1
        if slot >= 0:
            arena = self._arenas[slot]
            if arena is None or arena.size < p.length:
                self._arenas[slot] = None
                if arena is not None:
                    arena.close()
                # whole MiBs, so that frames growing by a few rows do not remake it
                arena = self._arenas[slot] = Segment.create(-(-p.length // _MIB) * _MIB)
            codec.write(arena.buf, 0, p)
            return codec.spill_plan(f"{slot} {arena.name}", codec.ARENA), slot
        seg = Segment.create(p.length)
        try:
            codec.write(seg.buf, 0, p)
        finally:
            seg.owner = False  # the reader unlinks it once mapped; close() sweeps leftovers
            seg.close()
        while self._spilled and not os.path.exists(self._spilled[0]):
            self._spilled.popleft()
        self._spilled.append(seg.path)
        return codec.spill_plan(seg.name), -1

    def _put(self, p: codec.Plan, timeout: Optional[float]) -> None:
        cap = self.capacity
        need = p.length
        head = self._head
        pos = head % cap
        room = cap - pos
        buf = self._buf
        if need > room:
            # pad to the end of the circle and publish the pad on its own, so
            # the reader can free the tail of the circle while we wait for the front
            self._wait_room(head + room - cap, timeout)
            codec.REC.pack_into(buf, _HEADER + pos, room, codec.PAD, 0, 0)
            head += room
            self._head = head
            _publish(buf, _OFF_HEAD, head, _OFF_RSLEEP)
            pos = 0
        if head + need - cap > self._tail_seen:
            self._wait_room(head + need - cap, timeout)
        codec.write(buf, _HEADER + pos, p)
        self._head = head + need
        _publish(buf, _OFF_HEAD, head + need, _OFF_RSLEEP)

    def _wait_room(self, target: int, timeout: Optional[float]) -> None:
        """Wait until the reader's tail reaches ``target``."""
        tail = _load(self._buf, _OFF_TAIL)
        if tail < target:
            tail = self._wait(_OFF_TAIL, _OFF_WSLEEP, target, tail, timeout, queue.Full)
        self._tail_seen = tail

    # -- receiving ----------------------------------------------------------

    @property
    def spin_window(self) -> float:
        """Seconds a wait keeps its CPU before it sleeps (``NEURONMP_IPC_SPIN_US``, or
        ``spin_budget`` when that is longer); 0.0 while ``spin`` is off."""
        return self.spin_window_on if self.spin else 0.0

    @property
    def spin_window_on(self) -> float:
        """The spin window a wait has while ``spin`` is on, whether it is on or not."""
        return max(self._spin, self.spin_budget)

    def pending(self) -> bool:
        """Whether a frame has been sent that this reader has not taken yet."""
        return _load(self._buf, _OFF_HEAD) != self._read

    def recv(self, timeout: Optional[float] = None) -> Any:
        """The next frame's value, as tensors that own their memory.

        Raises queue.Empty after ``timeout`` seconds without a frame,
        PeerDiedError if the writer died (or closed the ring) first.
        """
        start, end, value = self._next(timeout, True)
        if value is not NotImplemented:  # decoded, and the tail already moved past it
            self._read = end
            return value
        try:
            value = self._decode(start, True)
        finally:
            self._read = end
            if not self._views:
                self._store_tail(end)
        return value

    def recv_view(self, timeout: Optional[float] = None) -> Frame:
        """The next frame, its tensors viewing the ring; release it when done."""
        start, end, value = self._next(timeout, False)
        if start != self._read and not self._views:
            # give back the pads skipped on the way: the one before a ring's
            # restart spans most of the ring (see _frames.put)
            self._store_tail(start)
        self._read = end
        if value is NotImplemented:
            try:
                value = self._decode(start, False)
            except BaseException:
                if not self._views:
                    self._store_tail(end)
                raise
        frame = Frame(value, self, start)
        self._views.append(frame)
        return frame

    def recv_into(self, out, timeout: Optional[float] = None):
        """Copy the next frame, a lone tensor, into ``out``; return ``out``.

        For a receiver that reuses its own buffer: one copy out of the ring,
        no allocation.  ``out`` must be a contiguous CPU tensor of the frame's
        dtype and shape; otherwise ValueError, and the frame stays next in line.
        """
        if not isinstance(out, _Tensor) or not out.is_cpu or not out.is_contiguous():
            raise ValueError(f"Invalid out {type(out).__name__}: expected a contiguous CPU "
                             "torch.Tensor")
        frame = self.recv_view(timeout)
        x = frame.value
        if type(x) is not _Tensor or x.dtype != out.dtype or x.shape != out.shape:
            self._unread(frame)
            got = f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, _Tensor) \
                else type(x).__name__
            raise ValueError(f"Cannot receive a {got} into a {out.dtype} tensor of shape "
                             f"{tuple(out.shape)}: expected the same dtype and shape")
        try:
            _copy(out.data_ptr(), x.data_ptr(), x.nbytes)
        finally:
            del x
            frame.release()
        return out

    def recv_picked(self, pick: Callable[[Any], Any], timeout: Optional[float] = None) -> Any:
        """The next frame's value, where ``pick`` may take it without a fresh copy.

        ``pick(value)`` sees the frame's tensors viewing the ring (valid only during
        the call); it copies them where they belong and returns the value to use
        instead, or returns None: then the frame is received as ``recv`` does.  For
        a reader that knows, only once it has seen a frame, where that frame goes.
        """
        frame = self.recv_view(timeout)
        # a one-off segment is unlinked once mapped: its views already own their pages,
        # and it cannot be read again
        again = self._record_kind(frame._start) != codec.SPILL
        value = None
        try:
            value = pick(frame.value)
        finally:
            if value is None and again:
                self._unread(frame)
            else:
                value = frame.value if value is None else value
                frame.release()
        return self.recv(0) if value is None else value

    def _record_kind(self, start: int) -> int:
        return codec.REC.unpack_from(self._buf, _HEADER + start % self.capacity)[1]

    def _unread(self, frame: Frame) -> None:
        """Put the newest viewed frame back as the next one to receive."""
        self._views.remove(frame)
        frame._released = True
        frame.value = None
        self._read = frame._start

    def _next(self, timeout: Optional[float], copy: bool):
        """(start, end, value) of the next frame, skipping pads.

        ``value`` is NotImplemented for the kinds codec.read decodes.  A copy
        with no frame still viewed has already given its space back.
        """
        if self._closed:
            raise ValueError("recv on a closed ring")
        buf = self._buf
        release = copy and not self._views
        got = _get(buf, self._read, copy, release)
        if type(got) is tuple:
            return got
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._read = got  # past any pads
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._wait(_OFF_HEAD, _OFF_RSLEEP, got + 1, got, left, queue.Empty)
            got = _get(buf, self._read, copy, release)
            if type(got) is tuple:
                return got

    def _decode(self, start: int, copy: bool) -> Any:
        """The value of the record at ``start`` that the C decoder left to codec.py,
        fetched from its spill segment or arena when it travelled beside the ring."""
        kind, value = codec.read(self._buf, _HEADER + start % self.capacity, copy)
        if kind == codec.SPILL:
            return _take_spill(value, copy)
        if kind == codec.ARENA:
            return self._take_arena(value, copy)
        return value

    def _take_arena(self, record: str, copy: bool) -> Any:
        """Decode the frame on one of the writer's arenas, each mapped once and kept.

        ``record`` is "<slot> <name>".  A new name in a slot means the writer
        replaced that arena, which it does only once every frame on the old
        one was released: unmap the old one.
        """
        slot_text, name = record.split(" ", 1)
        slot = int(slot_text)
        seg = self._arenas_in[slot]
        if seg is None or seg.name != name:
            self._arenas_in[slot] = None
            if seg is not None:
                seg.close()
            seg = self._arenas_in[slot] = Segment.attach(name)
        return codec.read(seg.buf, 0, copy)[1]

    def _store_tail(self, tail: int) -> None:
        _publish(self._buf, _OFF_TAIL, tail, _OFF_WSLEEP)

    def _release_view(self, frame: Frame) -> None:
        views = self._views
        try:
            views.remove(frame)
        except ValueError:  # the ring was closed meanwhile
            return
        if self._closed:
            return
        self._store_tail(views[0]._start if views else self._read)

    # -- an event loop's waits, on a readiness fd -----------------------------

    def arm_fd(self) -> None:
        """Ask the peer to write our readiness fd after its next publish: the head
        (a reader) or the tail (a writer).  Stored with sequential consistency,
        so a re-read of the counter after it sees every publish that missed it."""
        if not self._closed:
            _publish(self._buf, _OFF_FDWAIT, 1, _OFF_ZERO)

    def disarm_fd(self) -> None:
        if not self._closed:
            _store(self._buf, _OFF_FDWAIT, 0)

    def take_fd_request(self) -> bool:
        """The peer's side, after a publish: whether the event loop asked for a
        write of its fd (the flag is then lowered; the caller writes)."""
        if self._closed or not _load(self._buf, _OFF_FDWAIT):
            return False
        _store(self._buf, _OFF_FDWAIT, 0)
        return True

    # -- waiting ------------------------------------------------------------

    def _wait(self, off: int, off_sleep: int, target: int, value: int,
              timeout: Optional[float], timeout_error) -> int:
        """Wait until the counter at ``off`` reaches ``target``; return its value."""
        deadline = None if timeout is None else time.monotonic() + timeout
        buf = self._buf
        spin = self._spin if self.spin else 0.0
        while True:
            if deadline is None:
                slice_ = _SLICE
            else:
                slice_ = min(_SLICE, deadline - time.monotonic())
                if slice_ <= 0:
                    raise timeout_error()
            if not spin:
                value = _wait(buf, off, value, off_sleep, _OFF_CLOSED, 0.0, slice_, 0.0)
            elif self.spin_budget > spin:
                budget = min(self.spin_budget, slice_)
                value = _wait(buf, off, value, off_sleep, _OFF_CLOSED, budget, slice_, budget)
            elif self._busy:
                self._busy -= 1
                value = _wait(buf, off, value, off_sleep, _OFF_CLOSED, self._pause_busy,
                              slice_, self._pause_busy)
            else:
                t0 = _now()
                value = _wait(buf, off, value, off_sleep, _OFF_CLOSED, spin, slice_, self._pause)
                if self._pause <= _now() - t0 < spin:  # longer: an idle peer, not a busy host
                    self._busy = _BUSY_WAITS
            if value >= target:
                return value
            spin = 0.0
            self._check_alive()

    def _check_alive(self) -> None:
        if self._closed:
            raise ValueError("the ring was closed while waiting")
        closed = _U32.unpack_from(self._buf, _OFF_CLOSED)[0]
        peer = self.peer
        pid = peer.pid if peer is not None else 0
        if closed:
            mine = _CLOSED_BY_OWNER if self._owner else _CLOSED_BY_ATTACHER
            if closed != mine:
                raise PeerDiedError(pid, f"it closed ring {self.name}")
        if peer is not None and not peer.alive():
            raise PeerDiedError(pid, f"it exited while this process waited on ring {self.name}")


def _write_ident(buf, off: int, ident: procid.ProcId) -> None:
    _U64.pack_into(buf, off + 8, ident.start)
    _store(buf, off, ident.pid)  # release: a reader seeing the pid sees the start


def _read_ident(buf, off: int) -> Optional[procid.ProcId]:
    pid = _load(buf, off)
    if not pid:
        return None
    return procid.ProcId(pid, _U64.unpack_from(buf, off + 8)[0])


def _take_spill(name: str, copy: bool) -> Any:
    """Map a one-off segment, unlink it, and decode its frame.

    The tensors view the private mapping even for ``copy``: once unlinked
    nobody else can reach those pages, so a view already owns its memory.
    """
    seg = Segment.attach(name)
    seg.unlink()
    _, value = codec.read(seg.buf, 0, False)
    return value


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
