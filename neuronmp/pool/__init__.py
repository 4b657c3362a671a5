"""Layer 5: one worker process per reserved NeuronCore, and the coordinator feeding them.

A :class:`Pool` is owned by the session of a runtime (``neuronmp.session``), which
starts it on the first model load and closes it when the runtime shuts down.
The coordinator (and so torch) loads on first use: monitors import
``neuronmp.pool.stats`` alone and stay torch-free.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .coordinator import Pool

__all__ = ["Pool"]


def __getattr__(name: str) -> Any:
    if name == "Pool":
        from .coordinator import Pool

        return Pool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
