"""Layer 5: one worker process per reserved NeuronCore, and the coordinator feeding them.

``get_pool()`` returns this process's pool, starting it on first use (after
reserving the cores through the runtime); the runtime stops it at shutdown.
The coordinator (and so torch) loads on first use: monitors import
``neuronmp.pool.stats`` alone and stay torch-free.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .coordinator import Pool

__all__ = ["Pool", "get_pool"]

_lock = threading.Lock()


def __getattr__(name: str) -> Any:
    if name == "Pool":
        from .coordinator import Pool

        return Pool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_pool(rt=None) -> Pool:
    """This process's worker pool over its reserved cores (started on first call)."""
    from .. import runtime
    from .coordinator import Pool

    rt = rt or runtime.get_runtime()
    with _lock:
        if rt._pool is None or rt._pool.closed:
            pool = Pool(rt.cores, rt.topology)
            rt._pool = pool
            rt.add_shutdown_hook(pool.close)
            _stop_on_sigterm()
        return rt._pool


def _stop_on_sigterm() -> None:
    """On SIGTERM, stop the workers and free the cores, then die of SIGTERM as usual.

    Only when nobody else handles SIGTERM: a user's own handler stays in charge
    (atexit still stops the pool if that handler exits normally).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum, frame):
        from .. import runtime

        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            runtime.shutdown()
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
