"""The transport: shared-memory rings carrying tensors between processes.

    coordinator                                   worker for core k
      Ring.create() --- name ---------------->    Ring.attach(name)
      send(args)  ==== request ring ==========>   recv()
      recv()      <=== response ring =========    send(result)

``Segment`` is a raw shared-memory file (also used for per-core statistics),
``Ring`` a single-producer single-consumer ring of tensor frames on one
segment, ``sweep()`` the start-up clean-up of segments left by dead processes.
``Segment`` and ``sweep`` import no torch; ``Ring`` (and its codec) load torch
on first use.
"""
from __future__ import annotations

from typing import Any

from .segment import Segment, owner_of, shm_dir, sweep

__all__ = ["Frame", "Ring", "Segment", "owner_of", "shm_dir", "sweep"]


def __getattr__(name: str) -> Any:
    if name in ("Ring", "Frame"):
        from . import ring

        return getattr(ring, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
