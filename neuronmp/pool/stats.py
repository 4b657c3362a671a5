"""Per-core statistics in shared memory, readable by any process of this user.

One segment per pool (in the runtime directory's ``shm/``, like the rings):

    [ header: magic | version | slots | owner pid | owner start ]
    [ slot 0: core | worker pid | submitted | done | errors | busy ns | restarts | running ]
    [ slot 1: ... ]

Every counter has a single writer, so no lock is needed: the coordinator
writes ``core``, ``worker pid``, ``submitted`` and ``restarts``; the worker of
the slot writes ``done``, ``errors``, ``busy ns`` and ``running`` (the request id it
is executing, 0 between requests: what the supervisor must not re-send after a
death).  In flight is
``submitted - done``.  A monitor (``neuronmp-top``) finds the segments by their
magic and reads them without attaching to anyone.  Imports no torch.
"""
from __future__ import annotations

import os
import struct
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence

from .. import procid
from ..ipc.segment import Segment, shm_dir

MAGIC = 0x3154415453504D4E  # "NMPSTAT1"
_HEADER = struct.Struct("<QQQQQ")  # magic, version, slots, owner pid, owner start
_SLOT = 64
_BASE = 64
FIELDS = ("core", "pid", "submitted", "done", "errors", "busy_ns", "restarts", "running")
_OFF = {name: i * 8 for i, name in enumerate(FIELDS)}
_Q = struct.Struct("<Q")
_DONE = struct.Struct("<3Q")  # done, errors, busy_ns: adjacent, all written by the worker


class CoreStats(NamedTuple):
    """A snapshot of one core's counters."""

    core: int
    pid: int
    submitted: int
    done: int
    errors: int
    busy_ns: int
    restarts: int
    running: int  # the request id the worker executes now, 0 if none
    owner: int  # pid of the process whose pool this is

    @property
    def in_flight(self) -> int:
        return max(0, self.submitted - self.done)


class StatsBlock:
    """The counters of one pool: ``create`` in the coordinator, ``attach`` in a worker."""

    def __init__(self, seg: Segment):
        self.seg = seg
        self.name = seg.name
        self._buf = seg.buf
        self.slots = _HEADER.unpack_from(seg.buf, 0)[2]  # the segment is page-rounded
        self._views: List[memoryview] = []  # handed out by counter(); released at close

    @classmethod
    def create(cls, cores: Sequence[int]) -> StatsBlock:
        seg = Segment.create(_BASE + _SLOT * len(cores))
        me = procid.current()
        _HEADER.pack_into(seg.buf, 0, 0, 1, len(cores), me.pid, me.start)
        block = cls(seg)
        for slot, core in enumerate(cores):
            block.set(slot, "core", core)
        _Q.pack_into(seg.buf, 0, MAGIC)  # last: monitors skip a block until it is whole
        return block

    @classmethod
    def attach(cls, name: str) -> StatsBlock:
        return cls(Segment.attach(name))

    def counter(self, slot: int, field: str) -> memoryview:
        """One counter as a one-item view (``view[0] += 1``): for the writer that
        counts every request, a struct round trip less each time."""
        off = _BASE + slot * _SLOT + _OFF[field]
        view = self._buf[off:off + 8].cast("Q")
        self._views.append(view)
        return view

    def set(self, slot: int, field: str, value: int) -> None:
        _Q.pack_into(self._buf, _BASE + slot * _SLOT + _OFF[field], value)

    def add(self, slot: int, field: str, delta: int = 1) -> None:
        """Increment a counter this process is the only writer of."""
        off = _BASE + slot * _SLOT + _OFF[field]
        _Q.pack_into(self._buf, off, _Q.unpack_from(self._buf, off)[0] + delta)

    def finished(self, slot: int, busy_ns: int) -> None:
        """A request is done after ``busy_ns`` of work (the worker's one update per request)."""
        off = _BASE + slot * _SLOT + _OFF["done"]
        done, errors, busy = _DONE.unpack_from(self._buf, off)
        _DONE.pack_into(self._buf, off, done + 1, errors, busy + busy_ns)

    def get(self, slot: int, field: str) -> int:
        return _Q.unpack_from(self._buf, _BASE + slot * _SLOT + _OFF[field])[0]

    def others_submitted(self, slot: int) -> int:
        """Requests ever submitted to the cores other than ``slot``'s."""
        buf, sub = self._buf, _OFF["submitted"]
        return sum(_Q.unpack_from(buf, _BASE + other * _SLOT + sub)[0]
                   for other in range(self.slots) if other != slot)

    def snapshot(self) -> List[CoreStats]:
        return _read(self._buf)

    def close(self) -> None:
        for view in self._views:
            view.release()
        self._views.clear()
        self.seg.close()


def _read(buf) -> List[CoreStats]:
    magic, _version, slots, owner, _start = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        return []
    out = []
    for slot in range(slots):
        vals = struct.unpack_from(f"<{len(FIELDS)}Q", buf, _BASE + slot * _SLOT)
        out.append(CoreStats(*vals, owner=owner))
    return out


def read_all(directory: Optional[str] = None) -> Dict[int, CoreStats]:
    """Every live pool's counters on this host, by global core (for monitors)."""
    directory = directory or shm_dir()
    found: Dict[int, CoreStats] = {}
    for _name, buf in _stat_segments(directory):
        for st in _read(buf):
            found[st.core] = st
    return found


def _stat_segments(directory: str) -> Iterator:
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as f:
                data = f.read(_BASE)
                if len(data) < _HEADER.size or _Q.unpack_from(data)[0] != MAGIC:
                    continue
                slots = _HEADER.unpack_from(data)[2]
                data += f.read(_SLOT * slots)
        except OSError:  # removed while we looked: its pool just shut down
            continue
        owner = procid.ProcId(*_HEADER.unpack_from(data)[3:5])
        if owner.alive():
            yield name, data
