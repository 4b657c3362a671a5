"""The coordinator: one worker process per reserved core, one supervisor, one answer type.

    call(core, mid, args)                           per core: _CoreWorker
       │ Answer registered in pending[rid]
       │ request ring.send((RUN, rid, mid, args)) ─────────────▶ worker process
       ▼                                                               │
    Answer.result(): the caller reads the response ring ◀──────────────┘
       itself while nobody else does (no thread hand-off); answers nobody
       waits on (callbacks, asyncio) are read by the core's reader thread;
       an answer with a Destination (``call(..., into=)``) is copied from the
       ring straight into its buffers, by whichever thread reads it

    an event loop may own a core instead (pool/loopchannel.py): it reads the
    response ring itself when the worker writes the core's readiness fd

    supervisor thread: waits on every worker's process sentinel
       a worker died ─▶ fail what it held (WorkerDiedError) ─▶ start another
                        on the same core ─▶ load its models again

Workers are forked from a forkserver that preloaded torch and the worker
module, so starting 16 of them costs one ``import torch``, not sixteen.  A
worker's death is noticed by the supervisor the moment the kernel reports it,
and the restart runs on the supervisor's thread, never on a caller's: a caller
only ever waits for its own answer.  ``close`` stops workers in stages: ask
(STOP), wait up to a shared deadline, then SIGKILL.
"""
from __future__ import annotations

import collections
import itertools
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import queue
import signal
import sys
import threading
import time
from concurrent.futures._base import RUNNING
from multiprocessing import reduction, spawn
from typing import Dict, Optional, Sequence, Tuple

from .. import envconfig, paths, procid
from ..errors import (
    ExecTimeoutError,
    ModelError,
    PeerDiedError,
    PoolClosedError,
    WorkerDiedError,
    WorkerPackageError,
)
from ..ipc import Ring, _waits, sweep
from ..supervise import stop_in_stages
from ..topology import Topology
from . import protocol as P
from .answer import Answer, Destination, Helper
from .stats import StatsBlock
from .weights import SharedWeights
from .weights import sweep as sweep_weights

# every setting is checked when the coordinator loads (the first model load), so a
# bad value fails in the caller, naming it, and not in every worker
_READY_TIMEOUT = envconfig.seconds("NEURONMP_WORKER_START_TIMEOUT", 120.0, low=0.001)
_RING_BYTES = envconfig.size("NEURONMP_RING_BYTES", 8 << 20, 64 << 10, 1 << 40)
_STOP_GRACE = 5.0
_START_TRIES = 3  # starts of a replacement worker before its core is given up
_HOLD = envconfig.microseconds("NEURONMP_WAIT_SPIN_US", 2000.0) * 1e-6
_WORKER_HOLD = envconfig.microseconds("NEURONMP_WORKER_SPIN_US", 200.0) * 1e-6
_HOLD_LONGEST = 1e-3  # requests that usually take longer than this are waited for asleep
# the Neuron runtime's bound on one execution (seconds; 0: none)
_EXEC_TIMEOUT = envconfig.seconds("NEURON_RT_EXEC_TIMEOUT", 30.0)
# see worker._keep_freed_memory; 0 keeps glibc's defaults
_KEEP_MB = envconfig.integer("NEURONMP_WORKER_KEEP_MB", 1024, 0, 1 << 20,
                             accepted="the megabytes a worker keeps for reuse, 0 to keep "
                                      "glibc's defaults")
# 1: the cores of a model map one read-only copy of its weights (pool/weights.py);
# 0: each core loads its own, writable copy (models that keep state in buffers)
_SHARE_WEIGHTS = envconfig.integer(
    "NEURONMP_SHARE_WEIGHTS", 1, 0, 1,
    accepted="1 to map one read-only copy of a model's weights into all its cores, 0 to "
             "give each core its own copy")
_context_lock = threading.Lock()
_no_main = threading.local()
_deferred = threading.local()  # .owed: the workers a batch of sends still has to wake
_reading = threading.local()  # .ahead: this thread waits for several cores' answers
_now_ns, _sleep_until = time.perf_counter_ns, _waits.sleep_until
# a reader waiting for a due answer on CPUs of its own sleeps this much short of the
# due time at first and spins the rest, then learns how late its sleeps wake
_MARGIN_FIRST, _MARGIN_MIN, _MARGIN_MAX = 80_000, 5_000, 500_000  # ns
# a thread waiting for several cores' answers (answers_read_ahead) reads the other
# cores' arrived answers this long before its own is due, plus a while per answer
# (see _read_others_first)
_AHEAD_NS, _AHEAD_EACH_NS = 300_000, 10_000
# threads spinning for a due answer on CPUs shared with other cores' workers: at most
# one at a time (a caller's own wait; see _deliver_held)
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
    wake-up each (see docs/performance.md for what that cost the 2-core
    BatchingServer)."""

    __slots__ = ("_was",)

    def __enter__(self) -> None:
        self._was = getattr(_reading, "ahead", False)
        _reading.ahead = True

    def __exit__(self, *exc) -> None:
        _reading.ahead = self._was


def _context(method: str = "forkserver"):
    """The start context; the forkserver preloads torch and the worker module once."""
    with _context_lock:
        ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(["neuronmp.pool.worker"])
        if not getattr(spawn.get_preparation_data, "_neuronmp", False):
            spawn.get_preparation_data = _preparation_without_main(spawn.get_preparation_data)
        return ctx


def _preparation_without_main(original):
    """Keep multiprocessing from re-running the user's ``__main__`` in our workers.

    multiprocessing re-imports the main script in every child so that targets
    defined there resolve; ours live in neuronmp, and a user script that calls
    a model at top level (as the Neuron examples do) must not run again in
    each worker.  Only starts made by this module (flagged per thread) are
    affected.
    """
    def prepare(name):
        data = original(name)
        if getattr(_no_main, "on", False):
            for key in ("init_main_from_path", "init_main_from_name", "main_path"):
                data.pop(key, None)
        return data

    prepare._neuronmp = True
    return prepare


class Pool:
    """Workers for ``cores`` (global ids) of ``topology``, started at construction.

    ``start_method`` is for comparisons only (tools/bench_startup.py): workers
    come from the forkserver unless told otherwise.
    """

    def __init__(self, cores: Sequence[int], topology: Topology, *,
                 start_method: str = "forkserver"):
        if not cores:
            raise ValueError("a pool needs at least one core")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"Invalid start_method {start_method!r}: expected "
                             "'forkserver' or 'spawn'")
        self._ctx = _context(start_method)
        sweep()  # segments of coordinators that died without closing
        sweep_weights()  # ... and their large shared weights (a bad NEURONMP_WEIGHTS_DIR
        # fails here, at start)
        self.cores: Tuple[int, ...] = tuple(cores)
        self._runtime_dir = paths.runtime_dir()
        self._cpus = frozenset(os.sched_getaffinity(0))
        self._cpu_users = collections.Counter(
            cpu for core in self.cores for cpu in topology.cpus_of(core))
        self._stats = StatsBlock.create(self.cores)
        self._ids = itertools.count(1)
        self._submits = 0
        self._closed = False
        self._pid = os.getpid()
        self._workers: Dict[int, _CoreWorker] = {}
        # id(graph bytes) -> (those bytes, their SharedWeights), while a core holds them
        self._weights: Dict[int, Tuple[bytes, SharedWeights]] = {}
        self._weights_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._supervisor: Optional[threading.Thread] = None
        try:
            for slot, core in enumerate(self.cores):
                self._workers[core] = _CoreWorker(self, core, slot, topology.cpus_of(core))
            deadline = time.monotonic() + _READY_TIMEOUT
            for w in self._workers.values():
                w.wait_ready(deadline)
        except BaseException:
            self.close()
            raise
        self._supervisor = threading.Thread(target=self._supervise, daemon=True,
                                            name="neuronmp-supervisor")
        self._supervisor.start()

    # -- requests -------------------------------------------------------------

    def call(self, core: int, mid: int, args: tuple,
             into: Optional[Destination] = None) -> Answer:
        """Run model ``mid`` on ``core`` with ``args``; the Answer of its outputs.

        Waiting on the answer (``result()``) reads the core's answers in the
        waiting thread while no other thread does, so a blocking call costs no
        hand-off between threads.  ``into``: buffers the outputs are copied into
        from the response ring when they match exactly (the answer is then made
        of them); else the answer holds fresh tensors and ``into`` stays untouched.
        """
        return self._worker(core).send(P.RUN, mid, args, into)

    def load(self, core: int, script_bytes: bytes, timing: Sequence[int] = ()) -> int:
        """Load a TorchScript module (``torch.jit.save`` bytes) on ``core``; its model id.

        ``timing`` (``DeviceTime.wire()``: nanosecond integers) makes each call of it
        take at least the modelled time on the core (see ``neuronmp.devicetime``)."""
        return self.load_all((core,), script_bytes, timing)[0]

    def load_all(self, cores: Sequence[int], script_bytes: bytes,
                 timing: Sequence[int] = ()) -> Tuple[int, ...]:
        """Load one TorchScript module on each of ``cores``; its model id on each.

        The model's parameters and buffers are written once into a shared segment
        that every one of these cores maps (``NEURONMP_SHARE_WEIGHTS``), and the
        cores load the rest (kilobytes) in parallel.  All or nothing: if one core
        fails, the others unload it.
        """
        if not isinstance(script_bytes, (bytes, bytearray, memoryview)):
            raise TypeError(f"script_bytes must be bytes, got {type(script_bytes).__name__}")
        timing = tuple(timing)
        if not all(isinstance(t, int) and t >= 0 for t in timing) or len(timing) % 2:
            raise ValueError(f"timing must be an even number of integers >= 0, got {timing}")
        workers = [self._worker(core) for core in cores]
        # bytes, or a model's memoryview of its wrapper's graph: neither copied here
        graph = script_bytes if isinstance(script_bytes, (bytes, memoryview)) else \
            bytes(script_bytes)
        weights = self._publish(graph) if _SHARE_WEIGHTS else None
        if weights is not None:
            graph = weights.skeleton
        try:
            return self._load_on(workers, graph, timing, weights)
        finally:
            if weights is not None:
                self._release_weights(weights)  # the cores that loaded it hold it now

    def _publish(self, graph) -> Optional[SharedWeights]:
        """The shared weights of ``graph``, written now unless a core already holds the
        same graph object (DataParallel loads one model per core, all from one graph:
        they all map one copy).

        Keyed by identity (the entry keeps the object, so its id stays its own): a
        content key would hash every byte, 0.1-0.2 s for 200 MB."""
        with self._weights_lock:
            entry = self._weights.get(id(graph))
            if entry is not None and entry[0] is graph and not entry[1].closed:
                entry[1].acquire()
                return entry[1]
            weights = SharedWeights.publish(graph)
            if weights is not None:
                self._weights[id(graph)] = (graph, weights)
            return weights

    def _load_on(self, workers, graph: bytes, timing: Tuple[int, ...],
                 weights: Optional[SharedWeights]) -> Tuple[int, ...]:
        spec = _LoadSpec(graph, timing, weights)
        # a skeleton is kilobytes: every core loads at once; a whole graph is one copy
        # of the weights per core in flight (ring, bytes, module): one core at a time
        together = weights is not None
        sent = []
        try:
            for w in workers:
                mid = next(self._ids)
                sent.append((w, mid, w.start_load(mid, spec)))
                if not together:
                    sent[-1][2].result()
            for _w, _mid, answer in sent:
                answer.result()
        except BaseException:
            for w, mid, _answer in sent:
                try:
                    w.unload(mid)
                except Exception:  # noqa: BLE001 - a closed pool or a dead core dropped it
                    pass
            raise
        return tuple(mid for _w, mid, _answer in sent)

    def _release_weights(self, weights: SharedWeights) -> None:
        with self._weights_lock:
            weights.release()
            if weights.closed:
                for key, (_graph, w) in list(self._weights.items()):
                    if w is weights:
                        del self._weights[key]

    def shared_weights(self) -> Tuple[SharedWeights, ...]:
        """The weight segments this pool owns now (for tests and tools)."""
        with self._weights_lock:
            return tuple(w for _graph, w in self._weights.values() if not w.closed)

    def unload(self, core: int, mid: int) -> None:
        """Forget model ``mid`` on ``core``."""
        self._worker(core).unload(mid)

    def info(self, core: int) -> dict:
        """What the worker of ``core`` reports of itself: pid, CPUs, torch threads, models."""
        return self._worker(core).send(P.INFO, 0, None).result()

    def worker_pid(self, core: int) -> int:
        """The pid of the worker currently serving ``core``."""
        return self._worker(core).pid

    def stats(self):
        """A snapshot of every core's counters (see ``stats.CoreStats``)."""
        return self._stats.snapshot()

    def _worker(self, core: int) -> _CoreWorker:
        if self._closed:
            raise PoolClosedError()
        try:
            return self._workers[core]
        except KeyError:
            raise ValueError(
                f"core {core} is not served by this pool (cores {list(self.cores)})"
            ) from None

    def _worker_hold(self, worker: _CoreWorker) -> float:
        """How long an idle worker stays awake for the next request: only on CPUs
        that back no other core (emulating 16 cores on 2 CPUs, it must yield)."""
        shared = any(self._cpu_users[cpu] > 1 for cpu in worker.cpus)
        return 0.0 if shared else _WORKER_HOLD

    def _spare_cpu(self, waited: _CoreWorker) -> bool:
        """Whether ``waited`` is the only worker with work and a CPU is left over."""
        for w in self._workers.values():
            if w.pending and w is not waited:
                return False
        return not self._cpus <= set(waited.cpus)

    # -- supervision ------------------------------------------------------------

    def _supervise(self) -> None:
        """Wait on every worker's death notice; replace the ones that die, and stop the
        ones that make no progress past NEURON_RT_EXEC_TIMEOUT (this thread only)."""
        poll = None if not _EXEC_TIMEOUT else min(1.0, _EXEC_TIMEOUT / 4)
        while not self._closed:
            watched = {w.death_handle(): w for w in self._workers.values()
                       if w.proc is not None and not (w.stopping or w.done)}
            ready = multiprocessing.connection.wait([self._wake_r, *watched], poll)
            for handle in ready:
                if handle == self._wake_r:
                    os.read(self._wake_r, 64)
                elif not self._closed:
                    self._replace(watched[handle])
            if poll is not None and not self._closed:
                now = time.monotonic()
                for w in watched.values():
                    w.check_progress(now, _EXEC_TIMEOUT)
                    owner = w.owner
                    if owner is not None and owner.loop_closed():
                        owner.orphan()   # its loop is gone: the reader thread reads

    def _replace(self, worker: _CoreWorker) -> None:
        try:
            worker.replace()
        except Exception as exc:  # noqa: BLE001 - the other cores must stay supervised
            print(f"neuronmp: could not restart the worker of NeuronCore {worker.core}: "
                  f"{exc!r}; requests to it fail", file=sys.stderr)

    def _wake_supervisor(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    # -- shutdown -------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float = _STOP_GRACE) -> None:
        """Stop every worker (ask, shared deadline, SIGKILL) and free the segments."""
        if self._closed:
            return
        self._closed = True
        self._wake_supervisor()
        sup = self._supervisor
        if sup is not None and sup is not threading.current_thread():
            sup.join(timeout)
        workers = list(self._workers.values())
        stop_in_stages(workers, ask=_CoreWorker.ask_stop, running=_CoreWorker.running,
                       kill=_CoreWorker.kill, grace=timeout)
        for w in workers:
            w.finish()
        with self._weights_lock:
            for _graph, weights in self._weights.values():
                weights.close()
            self._weights.clear()
        self._stats.close()
        sweep()  # what workers killed in the last stage left (spill arenas, .live files)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def forget_after_fork(self) -> None:
        """In a forked child: drop the parent's pool without touching its workers,
        rings or segments (they are the parent's to use and to remove)."""
        self._closed = True
        workers, self._workers = list(self._workers.values()), {}
        for w in workers:
            w._close_pidfd()
            w._close_ready_fd()
            # multiprocessing's exit handler would otherwise SIGTERM the parent's
            # (daemonic) workers when this child exits
            multiprocessing.process._children.discard(w.proc)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        _forget_forkserver()


class _CoreWorker(Helper):
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

    def __init__(self, pool: Pool, core: int, slot: int, cpus: Tuple[int, ...]):
        self.pool = pool
        self.core = core
        self.slot = slot
        self.cpus = cpus
        self.shared_cpus = any(pool._cpu_users[cpu] > 1 for cpu in cpus)
        self.models: Dict[int, _LoadSpec] = {}  # to load again after a restart
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
        self._held: Optional[tuple] = None
        # requests whose answers go into a Destination: while any is pending, answers
        # are looked at in the ring before they are copied out (``_fill``)
        self._into: set = set()
        # how early a reader wakes for a due answer and spins (learned; see _deliver_held)
        self._margin = _MARGIN_FIRST
        self._others_seen = -1  # requests sent to other cores, at the last wait
        self._submitted = pool._stats.counter(slot, "submitted")  # this core's, in place
        self._start_process()

    @property
    def pid(self) -> int:
        return self.proc.pid

    # -- process life ---------------------------------------------------------

    def _start_process(self) -> None:
        # unpopulated: 32 cores' 64 rings of 8 MiB cost 0.2 s of CPU to map up front, in
        # the coordinator and again in the workers; a ring's pages fault in on its
        # first lap instead (2048 faults of about 1.3 us over its first 8 MiB)
        self.req = Ring.create(_RING_BYTES, populate=False)
        self.resp = Ring.create(_RING_BYTES, populate=False)
        me = procid.current()
        self.proc = self.pool._ctx.Process(
            target=_worker_entry, name=f"neuronmp-nc{self.core}", daemon=True,
            args=(self.core, self.cpus, self.pool._runtime_dir, self.req.name, self.resp.name,
                  tuple(me), self.pool._stats.name, self.slot, self.pool._worker_hold(self),
                  _KEEP_MB, P.PACKAGE_DIR, _PassedFd(self.ready_fd)),
        )
        _no_main.on = True
        try:
            self.proc.start()
        finally:
            _no_main.on = False
        self._close_pidfd()
        try:  # the kernel's own death notice; the sentinel needs the forkserver to report
            self.pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):
            self.pidfd = None
        ident = procid.of(self.proc.pid) or procid.ProcId(self.proc.pid, 0)
        self.req.set_peer(ident)
        self.resp.set_peer(ident)
        self.pool._stats.set(self.slot, "pid", self.proc.pid)

    def death_handle(self):
        """What becomes readable when the process dies: its pidfd, else its sentinel."""
        return self.pidfd if self.pidfd is not None else self.proc.sentinel

    def _close_pidfd(self) -> None:
        fd, self.pidfd = self.pidfd, None
        if fd is not None:
            os.close(fd)

    def wait_ready(self, deadline: float) -> None:
        """Wait for the worker's greeting (the caller is the ring's only reader)."""
        try:
            rid, _ok, _pid, _due = self.resp.recv(
                timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(
                f"worker for NeuronCore {self.core} (pid {self.pid}) did not start within "
                f"{_READY_TIMEOUT:.0f} s (NEURONMP_WORKER_START_TIMEOUT)"
            ) from None
        except PeerDiedError:
            raise self._death() from None
        if rid != P.READY_ID:
            raise RuntimeError(f"worker for NeuronCore {self.core} sent {rid!r} before READY")
        if not _ok:   # it runs another copy of the package (worker_main's check)
            self.proc.join(2.0)
            raise WorkerPackageError(self.core, P.PACKAGE_DIR, _pid)
        if self.reader is None:
            self.reader = threading.Thread(target=self._read_loop, daemon=True,
                                           name=f"neuronmp-reader-nc{self.core}")
            self.reader.start()

    def _death(self) -> WorkerDiedError:
        self.proc.join(1.0)  # let the forkserver report the exit status
        return WorkerDiedError(self.core, self.proc.pid, self.proc.exitcode)

    def replace(self) -> None:
        """The process died: fail what it was running, re-send what it never read.

        Runs on the supervisor's thread.  Answers the dead worker had already sent
        are delivered; the one request it was executing (the stats block's
        ``running``) fails with WorkerDiedError (or ExecTimeoutError if the
        supervisor stopped it); every later request was never read, so it is sent
        again, in order, to the replacement, after the models are loaded again.
        Holding ``lock`` meanwhile queues new requests behind them.  No answer is
        settled on this thread while it holds a lock: a done-callback may send
        (retry a failed request), and would wait for the lock it holds.  Those
        settled before the restart are settled by a thread of their own, so their
        callers hear at once and their callbacks' sends queue like any other.
        """
        late: list = []   # (answer, ok, payload)
        try:
            self._replace(late)
        finally:
            for answer, ok, payload in late:
                self._settle(answer, ok, payload)
            owner = self.owner
            if owner is not None:   # its flag was raised on the dead worker's rings
                owner.kick()
        self.work.set()

    def _replace(self, late: list) -> None:
        self.dead = True   # a thread reading the ring leaves it (its pump checks)
        # rx_lock first: an answer's callbacks run in the thread that read it, with
        # rx_lock held, and may send (take lock)
        with self.rx_lock, self.lock:
            err = self._death()
            running = self.pool._stats.get(self.slot, "running")
            self.pool._stats.set(self.slot, "running", 0)
            late += self._drain()
            self._into.clear()  # re-sent requests are sent under new ids
            self.req.close()
            self.resp.close()
            sweep()  # what the dead worker wrote and nobody will read (its spill arena)
            held, self.pending = self.pending, {}
            again = self._triage(held, running, err, late)
            if self.stopping or _exiting():
                self.done = True
                late += [(e[0], False, err) for e in again]
                return
            # settled now, not after the restart (which may take seconds)
            _settle_apart(self, late[:])
            late.clear()
            self.pool._stats.add(self.slot, "restarts")
            try:
                self._restart()
            except BaseException:
                late += [(e[0], False, err) for e in again]
                self._abandon()
                raise
            self.dead = False
            loading = {e[2] for e in again if e[1] == P.LOAD}
            for mid, spec in list(self.models.items()):
                if mid not in loading:
                    self._send_locked(P.LOAD, mid, spec.payload())
            for answer, op, mid, payload, tries in again:
                self._send_locked(op, mid, payload, answer, tries + 1)

    def _restart(self) -> None:
        """Start the replacement; one killed while it starts (a chaos test, an OOM kill)
        is replaced again rather than leaving the core down for good."""
        for attempt in range(_START_TRIES):
            try:
                self._start_process()
                self.wait_ready(time.monotonic() + _READY_TIMEOUT)
                return
            except WorkerDiedError:
                if attempt + 1 == _START_TRIES:
                    raise
                for ring in (self.req, self.resp):
                    ring.close()
                sweep()

    def _drain(self) -> list:
        """The answers a dead worker sent before it died (rx_lock held), to settle now
        as ``(answer, ok, payload)``; those not due yet are settled when they are due,
        by a timer: the supervisor does not wait for them."""
        answers = [self._held] if self._held is not None else []
        self._held = None
        while True:
            try:
                rid, ok, payload, due = self.resp.recv(timeout=0)
            except (queue.Empty, PeerDiedError):
                break
            answers.append((due, rid, ok, payload))
        now = []
        for due, rid, ok, payload in answers:
            entry = self.pending.pop(rid, None) if rid != P.BYE_ID else None
            wait = (due - _now_ns()) / 1e9
            if entry is None:
                continue
            if wait <= 0:
                now.append((entry[0], ok, payload))
            else:
                timer = threading.Timer(wait, self._settle, (entry[0], ok, payload))
                timer.daemon = True
                timer.start()
        return now

    def _triage(self, held: dict, running: int, err: BaseException, late: list) -> list:
        """Of a dead worker's requests: fail the one it ran (and any re-sent once
        already that died unstarted: a request that kills its worker must not loop),
        added to ``late``; return the others, in send order, to send again."""
        again = []
        for rid, entry in held.items():
            answer, op, mid, _payload, tries = entry
            if rid == running or (tries and not running):
                timed_out = rid == self._timed_out
                late.append((answer, False, ExecTimeoutError(self.core, mid, _EXEC_TIMEOUT)
                             if timed_out else err))
            else:
                again.append(entry)
        self._timed_out = 0
        return again

    @staticmethod
    def _fail(entries, err: BaseException) -> None:
        for entry in entries:
            try:
                entry[0].set_exception(err)
            except Exception:  # already settled (cancelled): nothing to tell
                pass

    def check_progress(self, now: float, limit: float) -> None:
        """Stop the worker if it holds requests and finished none for ``limit`` seconds
        (a model stuck in a loop, a SIGSTOPped process); ``replace`` then fails the
        request it was running with ExecTimeoutError and re-sends the rest."""
        if not self.pending or self.dead:
            self._progress = (-1, now)
            return
        done = self.pool._stats.get(self.slot, "done")
        if done != self._progress[0]:
            self._progress = (done, now)
        elif now - self._progress[1] > limit:
            self._timed_out = self.pool._stats.get(self.slot, "running") or \
                next(iter(self.pending), 0)
            self._progress = (-1, now)
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _abandon(self) -> None:
        """A replacement failed to start: the core stays down, its segments go now."""
        self.done = True
        self._close_pidfd()
        if self.proc is not None and self.proc.pid is not None:
            self.proc.kill()
            self.proc.join(2.0)
        for ring in (self.req, self.resp):
            if ring is not None:
                ring.close()

    def _fail_pending(self, err: BaseException) -> None:
        failed, self.pending = self.pending, {}
        self._into.clear()
        self._fail(failed.values(), err)

    # -- requests -------------------------------------------------------------

    def send(self, op: int, mid: int, payload, into: Optional[Destination] = None) -> Answer:
        """Send one request; its Answer, read by its waiter or the reader thread."""
        answer = Answer(self, running=True)
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
        pool._submits += 1  # approximate across threads: only a hint for _hold
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
            self.pending.pop(rid, None)
            self._into.discard(rid)
            self._submitted[0] -= 1
            raise
        return answer

    def _timed(self, mid: int) -> bool:
        spec = self.models.get(mid)
        return spec is not None and bool(spec.timing)

    def wake(self) -> None:
        """Wake the worker for requests sent without a wake-up (``wakes_deferred``)."""
        with self.lock:
            if not (self.dead or self.done) and self.req is not None:
                self.req.wake_reader()

    def watch(self, answer: Answer) -> None:
        self.work.set()  # a callback needs the reader thread: nobody may wait

    def wait(self, answer: Answer, timeout: Optional[float]) -> None:
        """An Answer's waiter: read answers in this thread while nobody else does."""
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        self.resp.hold = self._hold()
        while answer._state is RUNNING:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return
            if not (self.done or self.dead) and self.owner is None and \
                    self.rx_lock.acquire(blocking=False):
                try:
                    self._pump(answer, deadline)
                finally:
                    self.rx_lock.release()
            else:  # another thread reads (or the supervisor fails it): it settles ours
                answer._wait_flag(0.002 if remaining is None else min(0.002, remaining))
        self.service = 0.8 * self.service + 0.2 * (time.monotonic() - start)

    def _hold(self) -> float:
        """How long a waiter may keep its CPU instead of sleeping on the futex.

        A futex wake-up costs tens of microseconds on a VM: worth saving on short
        requests, when this core is the only one used since the last wait and
        some CPU is spare.
        On long requests it is noise, and a spinning waiter slows the workers
        that share its physical core (hyperthreads), so then it sleeps at once.
        """
        others = self.pool._submits - self.submits
        alone, self._others_seen = others == self._others_seen, others
        if not _HOLD or not alone or self.service > _HOLD_LONGEST or \
                not self.pool._spare_cpu(self):
            return 0.0
        return _HOLD

    def start_load(self, mid: int, spec: _LoadSpec) -> Answer:
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
                self.send(P.UNLOAD, mid, None).result()
            finally:
                self._forget(mid)

    def _forget(self, mid: int) -> None:
        spec = self.models.pop(mid, None)
        if spec is not None and spec.weights is not None:
            self.pool._release_weights(spec.weights)

    # -- answers (only with rx_lock held) --------------------------------------

    def _pump(self, until: Optional[Answer], deadline: Optional[float] = None,
              slice_: float = 0.05) -> None:
        """Read answers until ``until`` is done (None: nothing pending) or the deadline.

        Short slices: a reader must notice soon that the supervisor settled its
        answer (the worker died) and leave the ring to it.
        """
        while not (self.done or self.dead):
            if until is not None and until._state is not RUNNING:
                return
            if until is None and (not self.pending or self.owner is not None):
                return
            wait = slice_
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    return
            if self._held is not None:
                self._deliver_held(wait, waiter=until is not None)
            elif not self._read_one(wait):
                return  # the supervisor replaces the worker and fails what it held

    def _read_one(self, wait: float) -> bool:
        """Read one answer (waiting at most ``wait`` s): held if it is not due yet,
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
            self._held = (due, rid, ok, payload)
        else:
            self._dispatch(rid, ok, payload)
        return True

    def _read_ahead(self) -> None:
        """Take an answer that has arrived off the ring now, without waiting, if no
        other thread reads here: held until it is due (see ``_read_others_first``)."""
        if self._held is None and self.pending and not (self.done or self.dead) and \
                self.owner is None and self.rx_lock.acquire(blocking=False):
            try:
                if self._held is None:
                    self._read_one(0)
            finally:
                self.rx_lock.release()

    def _deliver_held(self, wait: Optional[float], waiter: bool = False) -> None:
        """Sleep until the held answer is due (at most ``wait`` seconds; None: all the
        way), then dispatch it.  A later answer of this core is due no sooner, so
        nothing is read past it meanwhile.

        The sleep ends a learned margin early and spins the rest, as a timer wakes
        tens of microseconds late here.  On CPUs shared with other cores' workers
        only a caller waiting for its own answer (``waiter``) spins, one thread at a
        time: the workers have answered long before the due time, while reader
        threads and every lane of a server spinning would take the workers' CPUs."""
        due = self._held[0]
        until = due if wait is None else min(due, _now_ns() + int(wait * 1e9))
        if waiter and until == due and _reading.__dict__.get("ahead"):
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
            _due, rid, ok, payload = self._held
            self._held = None
            self._dispatch(rid, ok, payload)

    def _read_others_first(self, due: int) -> None:
        """Before a caller's last stretch to its own due answer, take the other cores'
        arrived answers off their rings (``_read_ahead``).

        A DataParallel call's chunks fall due microseconds apart; read only once
        due, each came later than the last (14 us at 8 emulated cores, a fifth of
        what the call spent beyond its modelled time), and a chunk read here goes
        into the call's joined output (``answer.Joint``) before it is due.  The
        read starts earlier the more answers there are to read (copying 31 out in
        Python takes about 10 us each), and only while the caller's own answer is
        not close: it costs one more timer wake-up.
        """
        if due - _now_ns() < _AHEAD_NS:
            return
        # _held read unlocked: a hint; _read_ahead looks again under the lock
        others = [w for w in self.pool._workers.values()
                  if w is not self and w.pending and w._held is None]
        if others:
            ahead = due - _AHEAD_NS - _AHEAD_EACH_NS * len(others)
            if ahead > _now_ns():
                _sleep_until(ahead, ahead)
            for w in others:
                w._read_ahead()

    def _fill(self, answer: tuple) -> Optional[tuple]:
        """``recv_picked``'s pick: an answer, still in the ring, whose request has a
        Destination goes into it (the answer then holds the buffers); None for any
        other answer (copied out as usual).  Written as soon as it is read, even when
        it is held until its due time: the owner's guard decides what may be written."""
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
        if rid == P.BYE_ID:
            self.done = True
            return
        entry = self.pending.pop(rid, None)
        if entry is not None:
            self._settle(entry[0], ok, payload)

    def _settle(self, answer: Answer, ok: bool, payload) -> None:
        try:
            if ok:
                answer.set_result(payload)
            elif isinstance(payload, BaseException):  # a neuronmp error, sent as itself
                answer.set_exception(payload)
            else:
                answer.set_exception(ModelError(self.core, *payload))
        except Exception:  # cancelled or timed out by its owner meanwhile
            pass

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
                    # thread, so it sleeps rather than spins until they come (32
                    # reader threads spinning cost DataParallel's caller 10% more CPU)
                    self.resp.spin = not self.shared_cpus
                    try:
                        self._pump(None, slice_=0.05)
                    finally:
                        self.resp.spin = True
            finally:
                self.rx_lock.release()

    # -- shutdown -------------------------------------------------------------

    def ask_stop(self) -> None:
        with self.lock:
            self.stopping = True
            if self.proc is None or self.req is None or self.req.closed:
                return
            try:
                self.req.send((P.STOP, 0, 0, None, 0), timeout=0.5)
            except (PeerDiedError, queue.Full, ValueError):
                pass
        self.work.set()

    def running(self) -> bool:
        """Whether the process still runs (joined, so its exit status is known)."""
        if self.proc is None or self.proc.pid is None:
            return False
        self.proc.join(0)
        return self.proc.exitcode is None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(2.0)

    def finish(self) -> None:
        """After the process ended: stop the reader, fail what is left, free the rings."""
        self.done = True
        self._close_pidfd()
        self.work.set()
        if self.reader is not None and self.reader is not threading.current_thread():
            self.reader.join(2.0)
        err = PoolClosedError("the neuronmp runtime shut down before this request finished")
        with self.rx_lock:
            if self._held is not None:  # computed: it only waits for its modelled end
                self._deliver_held(None)
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

    def _close_ready_fd(self) -> None:
        fd, self.ready_fd = self.ready_fd, -1
        if fd >= 0:
            os.close(fd)


def _settle_apart(worker: _CoreWorker, settled: list) -> None:
    """Settle ``(answer, ok, payload)`` items on a short-lived thread of their own."""
    if not settled:
        return

    def run() -> None:
        for answer, ok, payload in settled:
            worker._settle(answer, ok, payload)

    threading.Thread(target=run, daemon=True, name=f"neuronmp-settle-nc{worker.core}").start()


def _forget_forkserver() -> None:
    """In a forked child: the parent's forkserver is not this process's child, so
    multiprocessing could not start workers from it; the child's first pool starts
    its own.  Closing the inherited 'alive' descriptor lets the parent's forkserver
    exit when the parent does."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    with _context_lock:
        fd = server._forkserver_alive_fd
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        server.__init__()


def _exiting() -> bool:
    """The interpreter is exiting: multiprocessing's exit handler stops daemonic
    children (our workers) then, and none may be started again."""
    return sys.is_finalizing() or bool(getattr(multiprocessing.util, "_exiting", False))


class _LoadSpec:
    """What a core needs to load a model (again, after a restart): the graph (the
    skeleton when the weights are shared), the latency model, the shared weights."""

    __slots__ = ("graph", "timing", "weights")

    def __init__(self, graph: bytes, timing: Tuple[int, ...],
                 weights: Optional[SharedWeights]):
        self.graph = bytearray(graph)  # writable: sent as a tensor view, never copied again
        self.timing = timing
        self.weights = weights

    def payload(self) -> tuple:
        import torch

        wire = self.weights.wire() if self.weights is not None else None
        return (torch.frombuffer(self.graph, dtype=torch.uint8), self.timing, wire)


class _PassedFd:
    """A descriptor handed to a worker with the forkserver's start request.

    ``reduction.DupFd`` made while the Process is being started sends the fd along
    with the request; made any earlier, it falls back to multiprocessing's resource
    sharer, whose listener belongs to the process that first used it: in a child
    forked with os.fork() the worker would ask the parent for the fd, and die.
    """

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _passed, (reduction.DupFd(self.fd),)


def _passed(dup: object) -> object:
    return dup   # the worker detaches it, as it would a DupFd


def _worker_entry(*args) -> None:
    from .worker import worker_main

    worker_main(*args)
