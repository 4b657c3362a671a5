"""Per-core statistics in shared memory, readable by any process of this user.

One segment per pool (in the runtime directory's ``shm/``, like the rings):

    [ header: magic | version | slots | owner pid | owner start ]
    [ slot 0: counters (FIELDS, 8 bytes each) | latency samples (SAMPLES pairs) ]
    [ slot 1: ... ]

Every counter has a single writer, so no lock is needed: the coordinator
writes ``core``, ``worker pid``, ``submitted`` and ``restarts``, and its
supervisor the outcomes it decides (``timed_out``, ``died``); the worker of the
slot writes the rest: ``done``, ``errors``, ``busy ns`` and ``running`` (the
request id it is executing, 0 between requests: what the supervisor must not
re-send after a death), and per model execution its outcome (``runs``,
``model_errors``, ``runtime_errors``), the memory its models hold by kind
(``constants``: weights, ``model_code``: the graph without them, ``tensors``:
the last execution's inputs and outputs) and one latency sample pair.  In
flight is ``submitted - done``.

Latency samples: a ring of ``SAMPLES`` (device ns, total ns) pairs per slot and
``samples``, the count ever written; the worker writes the pair, then the
count.  A reader that remembers the count it saw last takes the pairs written
since (at most the last ``SAMPLES``) and drops any the writer may have been
overwriting meanwhile (``LatencyReader``).  A monitor (``neuronmp-top``,
``neuronmp-monitor``) finds the segments by their magic and reads them without
attaching to anyone or taking any lock.  Imports no torch.
"""
from __future__ import annotations

import os
import struct
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from ..host import procid
from ..shm.segment import Segment, shm_dir

MAGIC = 0x3154415453504D4E  # "NMPSTAT1"
VERSION = 2
_HEADER = struct.Struct("<QQQQQ")  # magic, version, slots, owner pid, owner start
FIELDS = ("core", "pid", "submitted", "done", "errors", "busy_ns", "restarts", "running",
          "runs", "model_errors", "runtime_errors", "timed_out", "died",
          "constants", "model_code", "tensors", "samples")
_COUNTERS = 256   # bytes of counters per slot: room for FIELDS to grow
#: latency sample pairs kept per core: a period with more executions is summed up by its last
SAMPLES = 512
_SLOT = _COUNTERS + SAMPLES * 16
_BASE = 64
_OFF = {name: i * 8 for i, name in enumerate(FIELDS)}
_IDX = {name: i for i, name in enumerate(FIELDS)}
_RING = _COUNTERS // 8   # the first sample's index in a slot's view of 8-byte items
_DONE_I, _BUSY_I, _RUNS_I, _SAMPLES_I, _TENSORS_I = (
    _IDX[f] for f in ("done", "busy_ns", "runs", "samples", "tensors"))
_Q = struct.Struct("<Q")
_DONE = struct.Struct("<3Q")  # done, errors, busy_ns: adjacent, all written by the worker
_ALL = struct.Struct(f"<{len(FIELDS)}Q")


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
    runs: int = 0  # model executions completed without an error
    model_errors: int = 0  # executions the model raised in
    runtime_errors: int = 0  # executions whose output could not be returned
    timed_out: int = 0  # executions stopped by NEURON_RT_EXEC_TIMEOUT
    died: int = 0  # executions whose worker died under them
    constants: int = 0  # bytes of the loaded models' weights
    model_code: int = 0  # bytes of the loaded models' graphs without their weights
    tensors: int = 0  # bytes of the last execution's inputs and outputs
    samples: int = 0  # latency sample pairs ever written
    owner: int = 0  # pid of the process whose pool this is
    owner_start: int = 0  # its start time: (owner, owner_start) names the process

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
        _HEADER.pack_into(seg.buf, 0, 0, VERSION, len(cores), me.pid, me.start)
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

    def recorder(self, slot: int) -> Recorder:
        """The worker's writer of ``slot``'s execution outcomes, memory and samples."""
        off = _BASE + slot * _SLOT
        view = self._buf[off:off + _SLOT].cast("Q")
        self._views.append(view)
        return Recorder(view)

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


class Recorder:
    """One slot's worker-written counters as items of one view: each update is an
    item store or two (no struct call, no name lookup), since it runs once per
    execution."""

    __slots__ = ("_v",)

    def __init__(self, view: memoryview):
        self._v = view

    def finished(self, busy_ns: int) -> None:
        """A request is done after ``busy_ns`` of work (``StatsBlock.finished``)."""
        v = self._v
        v[_DONE_I] += 1
        v[_BUSY_I] += busy_ns

    def ran(self, device_ns: int, total_ns: int) -> int:
        """A model execution completed: its sample pair, then the counts; returns the
        number of samples written before this one."""
        v = self._v
        n = v[_SAMPLES_I]
        at = _RING + 2 * (n % SAMPLES)
        v[at] = device_ns
        v[at + 1] = total_ns
        v[_SAMPLES_I] = n + 1   # after the pair: a reader never takes a half-written one
        v[_RUNS_I] += 1
        return n

    def tensors(self, nbytes: int) -> None:
        """The bytes of an execution's inputs and outputs (the core's live tensors)."""
        self._v[_TENSORS_I] = nbytes

    def failed(self, field: str) -> None:
        """An execution ended in an error of ``field``'s kind (model_errors, runtime_errors)."""
        self._v[_IDX[field]] += 1

    def memory(self, constants: int, model_code: int) -> None:
        """The bytes the core's loaded models hold now, by kind."""
        self._v[_IDX["constants"]] = max(0, constants)
        self._v[_IDX["model_code"]] = max(0, model_code)
        if not constants:
            self._v[_TENSORS_I] = 0   # nothing loaded: no buffers held


def _read(buf) -> List[CoreStats]:
    magic, version, slots, owner, start = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC or version != VERSION:
        return []
    return [CoreStats(*_ALL.unpack_from(buf, _BASE + slot * _SLOT), owner=owner,
                      owner_start=start) for slot in range(slots)]


def read_all(directory: Optional[str] = None) -> Dict[int, CoreStats]:
    """Every live pool's counters on this host, by global core (for monitors)."""
    directory = directory or shm_dir()
    found: Dict[int, CoreStats] = {}
    for _name, buf in _stat_segments(directory):
        for st in _read(buf):
            found[st.core] = st
    return found


def read_samples(directory: Optional[str] = None) -> Dict[int, Tuple[CoreStats, bytes]]:
    """Every live pool's counters with each slot's latency ring, by global core."""
    directory = directory or shm_dir()
    found: Dict[int, Tuple[CoreStats, bytes]] = {}
    for _name, buf in _stat_segments(directory, rings=True):
        for slot, st in enumerate(_read(buf)):
            off = _BASE + slot * _SLOT + _COUNTERS
            found[st.core] = (st, bytes(buf[off:off + SAMPLES * 16]))
    return found


def samples_between(ring: bytes, seen: int, now: int) -> List[Tuple[int, int]]:
    """The (device ns, total ns) pairs numbered ``seen`` .. ``now - 1`` still in
    ``ring`` (read after the count ``now``): at most the last ``SAMPLES - 1``, since
    the writer may have been replacing the oldest while the ring was copied."""
    first = max(seen, now - SAMPLES + 1)
    out = []
    for n in range(first, now):
        device, total = struct.unpack_from("<QQ", ring, 16 * (n % SAMPLES))
        out.append((device, total))
    return out


def _stat_segments(directory: str, rings: bool = False) -> Iterator:
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as f:
                data = f.read(_BASE)
                if len(data) < _HEADER.size or _Q.unpack_from(data)[0] != MAGIC:
                    continue
                slots = _HEADER.unpack_from(data)[2]
                if rings:
                    data += f.read(_SLOT * slots)
                else:   # the counters alone: neuronmp-top reads every second
                    for _slot in range(slots):
                        data += f.read(_COUNTERS)
                        f.seek(_SLOT - _COUNTERS, os.SEEK_CUR)
                        data += bytes(_SLOT - _COUNTERS)
        except OSError:  # removed while we looked: its pool just shut down
            continue
        owner = procid.ProcId(*_HEADER.unpack_from(data)[3:5])
        if owner.alive():
            yield name, data
