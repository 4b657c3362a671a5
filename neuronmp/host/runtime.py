"""The per-process runtime, neuronmp's ``nrt_init``: one per process, owning its cores.

    init()  (implicit on first use)
      settings.parse() --pin--> (topology, request, reserve timeout) --> reservation.reserve()
      --> Runtime(cores, topology, settings)  held until shutdown() or process exit
    shutdown()
      hooks, last registered first (the session stops its workers here)
      --> reservation.release()              holder records removed, locks dropped

The runtime holds every process hook, so nothing above it installs its own:
atexit and SIGTERM (shutdown, then die of SIGTERM as usual) and fork (the
child forgets the parent's runtime; fork hooks let the session above drop the
parent's workers without touching them).  Python lets only the main thread
install a signal handler, so the SIGTERM handler goes in at ``import neuronmp``
(or the first init or runtime call) made on the main thread: a runtime first
used from another thread is still shut down by a SIGTERM.  A process that never
ran neuronmp code on its main thread dies of SIGTERM without a shutdown; what
it leaves (holder records, segments) is removed by the next start-up's sweep,
which trusts only the kernel's word that a process is dead (liveness.py).

A runtime belongs to the process that created it.  A forked child starts with
none: its copies of the lock descriptors are closed without unlocking (which
would free the parent's cores), and it may init() its own.  The cores are
released at interpreter exit, and by the kernel whenever the process dies.

Imports no torch.
"""
from __future__ import annotations

import _thread
import atexit
import logging
import os
import signal
import threading
from typing import Callable, List, Optional, Tuple

from ..errors import PoolClosedError
from . import liveness
from . import paths as _paths
from . import reservation as _reservation
from . import settings as _settings
from .topology import Topology

log = logging.getLogger(__name__)


class Runtime:
    """This process's reserved cores and what must be stopped before they are given back."""

    def __init__(self, topology: Topology, held: _reservation.Reservation,
                 settings: _settings.Settings):
        self.topology: Topology = topology
        #: the settings parsed when this runtime started, fixed for its life
        self.settings: _settings.Settings = settings
        self.cores: Tuple[int, ...] = tuple(held.cores)
        self._reservation = held
        self._hooks: List[Callable[[], None]] = []
        self._fork_hooks: List[Callable[[], None]] = []
        self._closed = False
        self._pid = os.getpid()

    @property
    def closed(self) -> bool:
        return self._closed

    def add_shutdown_hook(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` at shutdown, before the cores are released; last added runs first."""
        if not callable(fn):
            raise TypeError(f"shutdown hook must be callable, got {fn!r}")
        self._hooks.append(fn)

    def add_fork_hook(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in a forked child, where this runtime is the parent's and is dropped."""
        if not callable(fn):
            raise TypeError(f"fork hook must be callable, got {fn!r}")
        self._fork_hooks.append(fn)

    def _close(self, dying: bool = False) -> None:
        """Run the hooks (LIFO), then release the cores; the first hook error is re-raised.

        ``dying``: the process is exiting; segments it made and never closed go too."""
        if self._closed:
            return
        self._closed = True
        first_error: Optional[BaseException] = None
        while self._hooks:
            hook = self._hooks.pop()
            try:
                hook()
            except BaseException as exc:  # every hook runs and the cores are freed regardless
                if first_error is None:
                    first_error = exc
                else:
                    log.error("shutdown hook %r also failed: %r", hook, exc, exc_info=exc)
        self._fork_hooks = []
        try:
            self._reservation.release()
            liveness.release(dying)  # before tidy: our .live file would keep the directory
            _reservation.tidy(os.path.dirname(self._reservation.directory))
        finally:
            _settings.unpin(self.settings)   # the tidy above still read this runtime's
        if first_error is not None:
            raise first_error

    def _forget_after_fork(self) -> None:
        self._closed = True
        self._hooks = []
        hooks, self._fork_hooks = self._fork_hooks, []
        for hook in hooks:
            try:
                hook()
            except Exception as exc:  # a child must start whatever a hook did
                log.error("fork hook %r failed: %r", hook, exc, exc_info=exc)
        self._reservation.forget_after_fork()
        _settings.unpin(self.settings)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<neuronmp Runtime cores={self.cores} topology={self.topology.name} {state}>"


_lock = threading.RLock()
_runtime: Optional[Runtime] = None
_hooks_installed = False
_sigterm_settled = False  # tried from the main thread: installed, or a user's handler kept
_terminated = threading.Event()  # set once a SIGTERM's shutdown is done (the kill follows)
_terminating = False  # a SIGTERM arrived: no new runtime, the process is about to die
# how long the main thread's exit waits for a SIGTERM's shutdown running on its thread
_TERMINATE_WAIT = 120.0


def init() -> Runtime:
    """Reserve this process's cores (idempotent) and return the runtime.

    Parses every setting once (settings.py); what every layer reads until
    shutdown().  Raises ConfigError for a bad value of any variable (VisibilityError
    for bad NEURON_RT_* core values), CoreUnavailableError when
    another process holds the cores (after NEURONMP_RESERVE_TIMEOUT seconds),
    RuntimeDirError for an unsafe runtime directory.
    """
    global _runtime
    with _lock:
        if _runtime is not None:
            return _runtime
        if _terminating:
            raise PoolClosedError("the neuronmp runtime is shutting down: this process "
                                  "received SIGTERM")
        _install_process_hooks()
        stop_on_sigterm()  # at every init: the first may have run on another thread
        current = _settings.parse()   # once per runtime: see settings.py
        _settings.pin(current)
        try:
            _sweep_dead()
            held = _reservation.reserve(current.request, current.topology,
                                        timeout=current.reserve_timeout)
        except BaseException:
            _settings.unpin(current)
            raise
        _runtime = Runtime(current.topology, held, current)
        return _runtime


def get_runtime() -> Runtime:
    """The runtime of this process, initialising it on first use."""
    if not _sigterm_settled:
        stop_on_sigterm()
    rt = _runtime
    return rt if rt is not None else init()


def is_initialized() -> bool:
    return _runtime is not None


def shutdown() -> None:
    """Stop what runs on the cores, then release them.  Idempotent; init() works again after."""
    _shutdown(dying=False)


def _shutdown(dying: bool) -> None:
    global _runtime
    with _lock:
        rt, _runtime = _runtime, None
    if rt is not None:
        rt._close(dying)
        return
    liveness.release(dying)  # segments made without a runtime (tools, tests)
    if dying:
        _tidy()


def visible_cores() -> Tuple[int, ...]:
    """Global ids of the cores this process reserved, ascending (reserving on first use)."""
    return get_runtime().cores


def _install_process_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_at_exit)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)


def stop_on_sigterm() -> None:
    """On SIGTERM, shut down (workers stopped, cores freed), then die of SIGTERM as usual.

    Only from the main thread (Python allows no other to install a handler; the
    call is then a no-op) and only when nobody else handles SIGTERM: a user's own
    handler stays in charge (atexit still shuts down if that handler exits
    normally).  Without a runtime the handler just dies of SIGTERM, as before.
    """
    global _sigterm_settled
    if threading.current_thread() is not threading.main_thread():
        return
    _sigterm_settled = True
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    global _terminating
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _terminating = True
    # Not on this thread: the handler runs on the main thread wherever it was, maybe
    # inside a lock the shutdown takes (a BatchingServer's, an Event's), which the
    # main thread could not release while the shutdown waited for it.  A bare
    # thread takes none of threading's locks to start.
    _thread.start_new_thread(_die_of_sigterm, ())


def _die_of_sigterm() -> None:
    try:
        rt = _runtime
        if rt is None or rt._pid == os.getpid():
            _shutdown(dying=True)
    finally:
        _terminated.set()
        os.kill(os.getpid(), signal.SIGTERM)   # SIG_DFL now: die of it, as usual


def _tidy() -> None:
    try:
        base = _paths.existing_runtime_dir()
        if base is not None:
            _reservation.tidy(base)
    except Exception:  # noqa: BLE001 - a directory we may not judge is left alone
        pass


def _sweep_dead() -> None:
    """Remove what dead processes left (records, segments): their handlers may never
    have run.  Only the kernel's word that a process is dead counts (liveness)."""
    base = _paths.existing_runtime_dir()
    if base is not None:
        _reservation.sweep_stale(base)


def _at_exit() -> None:
    if _terminating:   # the SIGTERM's shutdown runs on its own thread and ends the process
        _terminated.wait(_TERMINATE_WAIT)
        return
    rt = _runtime
    if rt is None or rt._pid == os.getpid():
        _shutdown(dying=True)


def _after_fork_in_child() -> None:
    # the parent's lock may have been held by another thread at fork time
    global _lock, _runtime
    _lock = threading.RLock()
    rt, _runtime = _runtime, None
    if rt is not None:
        rt._forget_after_fork()
