"""The torch-side session of a runtime: the one owner of its pool, core book and models.

    runtime (torch-free: cores, process hooks)
        │ add_shutdown_hook(session.close), add_fork_hook(session.forget_after_fork)
        ▼
    Session ── book:   how many models use each visible core (coreuse.Book)
            ── pool:   the worker processes, started on the first model load
            ── loaded: handle -> Loaded (a model's placement and its copies in the pool)

The session owns a runtime's pool: ``call`` sends one message to a core,
``loop_channel`` lets an event loop own a core's rings, ``core_stats`` reads this
pool's per-core counters.  The pool starts on the first model load, so
``import neuronmp.session.session`` stays torch-free and cheap.

Nothing else caches a pool, a core or a pool model id: a model asks its
``Loaded`` record, which dies with the session (runtime shutdown, or a fork:
the child's first call starts a runtime of its own, which reserves cores like
any process and is refused the parent's, naming the parent).
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Deque, Dict, List, Optional, Tuple

from ..errors import PoolClosedError
from ..host import runtime as _runtime
from .coreuse import Book

__all__ = ["Loaded", "Session", "active", "current"]


class Loaded:
    """Where one model is loaded in one session: local cores and (global core, pool id)."""

    __slots__ = ("session", "placement", "targets", "live", "next")

    def __init__(self, session: Session, placement: Tuple[int, ...],
                 targets: Tuple[Tuple[int, int], ...]):
        self.session = session
        self.placement = placement
        self.targets = targets
        self.live = True
        self.next = 0  # round robin over targets


class Session:
    """Per-runtime torch-side state (see the module docstring)."""

    def __init__(self, rt: _runtime.Runtime):
        self.runtime = rt
        self.cores: Tuple[int, ...] = rt.cores
        self.book = Book(len(rt.cores))
        self.loaded: Dict[int, Loaded] = {}
        self.closed = False
        self._pool = None
        self._lock = threading.RLock()
        # (core, pool id) of released models: unloaded at the next load, never from a
        # GC callback (a finalizer may run on any thread, at any allocation)
        self._unloads: Deque[Tuple[int, int]] = collections.deque()

    @property
    def pool(self):
        """The worker pool, started on first use."""
        pool = self._pool
        if pool is not None:
            return pool
        with self._lock:
            if self.closed:
                raise PoolClosedError()
            if self._pool is None:
                from ..pool.coordinator import Pool

                self._pool = Pool(self.cores, self.runtime.topology)
            return self._pool

    # -- the pool, for the layers above -------------------------------------------

    def call(self, core: int, mid: int, payload: tuple, into: Any = None,
             future: bool = True):
        """Send ``payload`` (``(n_batches, *inputs)``) to model ``mid`` on global core
        ``core``; its Answer (outputs written into ``into``, a Destination, if given),
        or with ``future=False`` a Pending, for a caller that only waits for it."""
        return self.pool.call(core, mid, payload, into, future)

    def loop_channel(self, core: int, loop: Any, held: Any = None):
        """The channel through which event loop ``loop`` owns global core ``core``:
        ``held`` (the caller's channel for it) while it still serves this session's
        pool, else the loop's own or a new one; None when another running loop owns
        the core (send with :meth:`call` then).  On the loop's thread."""
        pool = self.pool
        if held is not None and not held.closed and held.worker.pool is pool:
            return held   # the per-request case: no lookup of the pool's lazy names
        from ..pool.loopchannel import channel_for

        return channel_for(pool._worker(core), loop)

    def core_stats(self) -> List[Any]:
        """A snapshot of every core's counters (``pool.stats.CoreStats``: busy time,
        requests in flight); empty while no model is loaded (no workers run)."""
        pool = self._pool
        return [] if pool is None else pool.stats()

    # -- models ---------------------------------------------------------------------

    def load(self, handle: int, graph: bytes, block: Tuple[int, ...],
             timing: Tuple[int, ...] = ()) -> Loaded:
        """Load ``graph`` on the local cores ``block`` (already counted in the book);
        ``timing`` is its latency model (``DeviceTime.wire()``), if any."""
        pool = self.pool
        self._drain_unloads(pool)
        cores = [self.cores[index] for index in block]
        try:
            targets = list(zip(cores, pool.load_all(cores, graph, timing)))
        except BaseException:
            self.book.release(block)
            raise
        record = Loaded(self, block, tuple(targets))
        with self._lock:
            old = self.loaded.pop(handle, None)
            self.loaded[handle] = record
        if old is not None:
            self._drop(old, defer=False)
        return record

    def release(self, handle: int, *, defer: bool = True) -> None:
        """Forget a model: uncount its cores; unload its copies (at the next load if
        ``defer``, as from a finalizer)."""
        with self._lock:
            record = self.loaded.pop(handle, None)
        if record is not None:
            self._drop(record, defer)

    def _drop(self, record: Loaded, defer: bool) -> None:
        record.live = False
        self.book.release(record.placement)
        if defer or self._pool is None:
            self._unloads.extend(record.targets)
        else:
            for core, mid in record.targets:
                _unload_quietly(self._pool, core, mid)

    def _drain_unloads(self, pool) -> None:
        while self._unloads:
            try:
                core, mid = self._unloads.popleft()
            except IndexError:
                return
            _unload_quietly(pool, core, mid)

    # -- life -----------------------------------------------------------------------

    def close(self) -> None:
        """Stop the pool; every model's record dies (they load again under a new runtime)."""
        with self._lock:
            self.closed = True
            records, self.loaded = list(self.loaded.values()), {}
            pool, self._pool = self._pool, None
        for record in records:
            record.live = False
        if pool is not None:
            pool.close()

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's workers are not ours; drop without touching."""
        self.closed = True
        for record in self.loaded.values():
            record.live = False
        self.loaded = {}
        if self._pool is not None:
            self._pool.forget_after_fork()
            self._pool = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<neuronmp Session cores={self.cores} models={len(self.loaded)} {state}>"


_lock = threading.Lock()
_current: Optional[Session] = None


def current() -> Session:
    """This runtime's session (initialising the runtime, and the session, on first use)."""
    s = _current
    if s is not None and not s.closed:
        return s
    return _start()


def _start() -> Session:
    global _current
    rt = _runtime.get_runtime()
    with _lock:
        s = _current
        if s is None or s.closed or s.runtime is not rt:
            s = Session(rt)
            rt.add_shutdown_hook(s.close)
            rt.add_fork_hook(s.forget_after_fork)
            _current = s
        return s


def active() -> Optional[Session]:
    """The open session, if any, without starting one."""
    s = _current
    return s if s is not None and not s.closed else None


def _unload_quietly(pool, core: int, mid: int) -> None:
    try:
        pool.unload(core, mid)
    except Exception:  # a closed pool or a dead worker has already dropped it
        pass
