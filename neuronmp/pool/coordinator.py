"""The coordinator: one worker process per reserved core, fed through one channel each.

    Pool (the runtime's, one per session)
      ├─ CoreChannel per core (channel.py): its rings, pending answers, readers
      │     ├─ its worker process (workerproc.py, from a forkserver)
      │     └─ device-time pacing and spin budgets (pacing.py)
      ├─ supervisor thread (supervisor.py): a worker died ─▶ fail what it ran,
      │     start another on the same core, load its models, send again the rest
      └─ WeightShelf (shelf.py): shared weight segments counted per core

``Pool`` is the executor: it starts the workers, routes each request to its
core's channel, loads models on cores (all or nothing) and closes in stages:
ask (STOP), wait up to a shared deadline, then SIGKILL.  The public names
(``Pool``) come from the package ``neuronmp.pool``.
"""
from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..errors import PoolClosedError
from ..host import paths
from ..host.supervise import stop_in_stages
from ..host.topology import Topology
from ..shm.segment import sweep
from . import limits
from . import protocol as P
from .answer import Answer, Destination, Pending
from .channel import CoreChannel, send_runs
from .pacing import answers_read_ahead, wakes_deferred
from .shelf import LoadSpec, WeightShelf
from .stats import StatsBlock
from .supervisor import supervise
from .weights import SharedWeights
from .weights import sweep as sweep_weights
from .workerproc import _context, _forget_forkserver

__all__ = ["Pool", "answers_read_ahead", "wakes_deferred"]

# the name tests and tools patch the channel class by
_CoreWorker = CoreChannel


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
        self._workers: Dict[int, CoreChannel] = {}
        self._shelf = WeightShelf()
        self._wake_r, self._wake_w = os.pipe()
        self._supervisor: Optional[threading.Thread] = None
        try:
            for slot, core in enumerate(self.cores):
                self._workers[core] = CoreChannel(self, core, slot, topology.cpus_of(core))
            deadline = time.monotonic() + limits.ready_timeout()
            for w in self._workers.values():
                w.wait_ready(deadline)
        except BaseException:
            self.close()
            raise
        self._supervisor = threading.Thread(target=supervise, args=(self,), daemon=True,
                                            name="neuronmp-supervisor")
        self._supervisor.start()

    # -- requests -------------------------------------------------------------

    def call(self, core: int, mid: int, args: tuple,
             into: Optional[Destination] = None, future: bool = True
             ) -> Union[Answer, Pending]:
        """Run model ``mid`` on ``core`` with ``args``; the Answer of its outputs.

        Waiting on the answer (``result()``) reads the core's answers in the
        waiting thread while no other thread does, so a blocking call costs no
        hand-off between threads.  ``into``: buffers the outputs are copied into
        from the response ring when they match exactly (the answer is then made
        of them); else the answer holds fresh tensors and ``into`` stays untouched.
        ``future=False``: a :class:`~neuronmp.pool.answer.Pending` instead, for a
        caller that only waits for it (no callbacks, no cancellation; cheaper).
        """
        return self._worker(core).send(P.RUN, mid, args, into, future)

    def load(self, core: int, script_bytes: bytes, timing: Sequence[int] = ()) -> int:
        """Load a TorchScript module (``torch.jit.save`` bytes) on ``core``; its model id.

        ``timing`` (``DeviceTime.wire()``: nanosecond integers) makes each call of it
        take at least the modelled time on the core (see ``neuronmp.host.devicetime``)."""
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
        weights = self._shelf.publish(graph) if limits.share_weights() else None
        if weights is not None:
            graph = weights.skeleton
        try:
            return self._load_on(workers, graph, timing, weights)
        finally:
            if weights is not None:
                self._shelf.release(weights)  # the cores that loaded it hold it now

    def _load_on(self, workers, graph: bytes, timing: Tuple[int, ...],
                 weights: Optional[SharedWeights]) -> Tuple[int, ...]:
        spec = LoadSpec(graph, timing, weights)
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

    def shared_weights(self) -> Tuple[SharedWeights, ...]:
        """The weight segments this pool owns now (for tests and tools)."""
        return self._shelf.owned()

    def unload(self, core: int, mid: int) -> None:
        """Forget model ``mid`` on ``core``."""
        self._worker(core).unload(mid)

    def info(self, core: int) -> dict:
        """What the worker of ``core`` reports of itself: pid, CPUs, torch threads, models,
        and whether its next wait for a request spins (``spins``, see worker._keep_spinning)."""
        return self._worker(core).send(P.INFO, 0, None, future=False).result()

    def worker_pid(self, core: int) -> int:
        """The pid of the worker currently serving ``core``."""
        return self._worker(core).pid

    def stats(self):
        """A snapshot of every core's counters (see ``stats.CoreStats``)."""
        return self._stats.snapshot()

    def call_each(self, cores: Sequence[int], mids: Sequence[int], payloads: Sequence[tuple],
                  into: Optional[Destination] = None) -> List[Pending]:
        """``call(cores[k], mids[k], payloads[k], into, future=False)`` for each ``k``, on
        distinct cores, sent together: stamped as one, published in one C call, the
        workers woken once all are (``channel.send_runs``, which says why)."""
        if len(set(cores)) != len(cores):
            raise ValueError(f"call_each: each core once, got cores {list(cores)}")
        if self._closed:
            raise PoolClosedError()
        workers = self._workers
        try:
            channels = [workers[core] for core in cores]
        except KeyError:
            for core in cores:
                self._worker(core)   # raises, naming the core
            raise
        return send_runs(channels, mids, payloads, into)

    def _worker(self, core: int) -> CoreChannel:
        if self._closed:
            raise PoolClosedError()
        try:
            return self._workers[core]
        except KeyError:
            raise ValueError(
                f"core {core} is not served by this pool (cores {list(self.cores)})"
            ) from None

    def _worker_spin_budget(self, worker: CoreChannel) -> float:
        """How long an idle worker stays awake for the next request: only on CPUs
        that back no other core (emulating 16 cores on 2 CPUs, it must yield)."""
        shared = any(self._cpu_users[cpu] > 1 for cpu in worker.cpus)
        return 0.0 if shared else limits.worker_spin()

    def _spare_cpu(self, waited: CoreChannel) -> bool:
        """Whether ``waited`` is the only worker with work and a CPU is left over."""
        for w in self._workers.values():
            if w.pending and w is not waited:
                return False
        return not self._cpus <= set(waited.cpus)

    def _wake_supervisor(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    # -- shutdown -------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float = limits.STOP_GRACE) -> None:
        """Stop every worker (ask, shared deadline, SIGKILL) and free the segments."""
        if self._closed:
            return
        self._closed = True
        self._wake_supervisor()
        sup = self._supervisor
        if sup is not None and sup is not threading.current_thread():
            sup.join(timeout)
        workers = list(self._workers.values())
        stop_in_stages(workers, ask=CoreChannel.ask_stop, running=CoreChannel.running,
                       kill=CoreChannel.kill, grace=timeout)
        for w in workers:
            w.finish()
        self._shelf.close()
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
