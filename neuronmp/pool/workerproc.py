"""A core's worker process: its start from the forkserver, its greeting, its stop.

    Pool ──_context()──▶ forkserver (preloaded torch and pool.worker)
                             │ fork, with the rings' names and the readiness fd
                             ▼
                         worker_main (pool/worker.py) ──READY──▶ wait_ready
    close: ask_stop (STOP) ─▶ running? until a shared deadline ─▶ kill (SIGKILL)

Workers are forked from a forkserver that preloaded torch and the worker
module, so starting 16 of them costs one ``import torch``, not sixteen.  This
module also holds multiprocessing's workarounds that starting them needs: the
user's ``__main__`` is not re-run in a worker, a descriptor is passed with the
start request, and a process forked from the coordinator forgets the parent's
forkserver.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import queue
import sys
import threading
import time
from multiprocessing import reduction, spawn

from ..errors import PeerDiedError, WorkerDiedError, WorkerPackageError
from ..host import procid
from ..ipc.ring import Ring
from . import limits
from . import protocol as P

_context_lock = threading.Lock()
_no_main = threading.local()


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


class WorkerProcess:
    """The process side of a core's channel (``channel.CoreChannel``): the worker
    process, its pidfd, its two rings, and stopping it in stages."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _start_process(self) -> None:
        # unpopulated: mapping every core's two rings up front costs CPU in the
        # coordinator and again in the workers; a ring's pages fault in on its first
        # lap instead (docs/performance.md, "Start-up, memory and shared weights")
        self.req = Ring.create(limits.ring_bytes(), populate=False)
        self.resp = Ring.create(limits.ring_bytes(), populate=False)
        me = procid.current()
        self.proc = self.pool._ctx.Process(
            target=_worker_entry, name=f"neuronmp-nc{self.core}", daemon=True,
            args=(self.core, self.cpus, self.pool._runtime_dir, self.req.name, self.resp.name,
                  tuple(me), self.pool._stats.name, self.slot, self.pool._worker_spin_budget(self),
                  limits.keep_mb(), P.PACKAGE_DIR, _PassedFd(self.ready_fd)),
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
                f"{limits.ready_timeout():.0f} s (NEURONMP_WORKER_START_TIMEOUT)"
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

    def _close_ready_fd(self) -> None:
        fd, self.ready_fd = self.ready_fd, -1
        if fd >= 0:
            os.close(fd)



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
