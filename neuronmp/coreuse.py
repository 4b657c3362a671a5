"""Core usage bookkeeping: which of this process's cores each traced model occupies.

Bookkeeping is per runtime: how many models use each visible core (local index).

    new model (trace / torch.jit.load) ──▶ current_request() ──▶ choose()
        inside neuron_cores_context(s, n): (s, n)       │  validate, then
        inside multicore_context():        all cores    │  start = s, or the least used
        otherwise:                         (-1, -1)     │  core after the last pick
                                                        ▼
                                   usage[core] += 1 for the chosen block
    set_neuron_cores / set_multicore: release the old block, choose a new one

Default placement follows the SDK: the least-used core, scanning in linear order from
the core after the previous pick and wrapping, so successive loads go round robin.
Indexes are always relative to the cores visible to this process (``nc:0`` first).
The public placement API (placement.py) sits above the models (ops.py) and
drives this; ops.py asks it where a new model goes.  The placement contexts
are, as in the SDK, not thread-safe.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional, Tuple

from . import runtime as _runtime


class _AllCores:
    """The internal nc_count of set_multicore / multicore_context: every visible core."""

    def __repr__(self) -> str:
        return "MULTICORE"


MULTICORE: Any = _AllCores()

_lock = threading.RLock()   # re-entrant: model finalizers may run inside a locked section
_book = {"runtime": None, "usage": [], "next": 0}
_request: Optional[Tuple[int, int]] = None


def _usage() -> list:
    rt = _runtime.get_runtime()
    if _book["runtime"] is not rt:
        _book.update(runtime=rt, usage=[0] * len(rt.cores), next=0)
    return _book["usage"]


def visible_count() -> int:
    """How many NeuronCores this process sees (initializes the runtime)."""
    return len(_runtime.get_runtime().cores)


def validate(start_nc: int, nc_count: int) -> None:
    """Raise ValueError, with the SDK's wording, for a placement that cannot be honoured."""
    visible = visible_count()
    if nc_count is MULTICORE:
        return
    for name, value in (("start_nc", start_nc), ("nc_count", nc_count)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if nc_count == 0:
        raise ValueError("Invalid NeuronCore count nc_count=0. Cannot be set to 0")
    if nc_count < -1:
        raise ValueError(
            f"Invalid NeuronCore count nc_count={nc_count}. Must be -1 (one NeuronCore) "
            f"or between 1 and the {visible} visible NeuronCore(s)"
        )
    if nc_count > visible:
        raise ValueError(
            f"Invalid NeuronCore count nc_count={nc_count}. Cannot be greater than the "
            f"number of visible NeuronCores ({visible})"
        )
    if start_nc < -1 or start_nc >= visible:
        raise ValueError(
            f"Invalid NeuronCore start index start_nc={start_nc}. Must be -1 (least used) "
            f"or between 0 and {visible - 1} (indexes of the {visible} visible NeuronCores)"
        )
    count = max(nc_count, 1)
    if start_nc >= 0 and start_nc + count > visible:
        raise ValueError(
            f"Invalid NeuronCore placement start_nc={start_nc}, nc_count={nc_count}: needs "
            f"nc:{start_nc}-nc:{start_nc + count - 1}, but only nc:0-nc:{visible - 1} are visible"
        )


def choose(start_nc: int = -1, nc_count: int = -1) -> Tuple[int, ...]:
    """Pick and count a block of local cores for one model (validated first)."""
    validate(start_nc, nc_count)
    with _lock:
        usage = _usage()
        n = len(usage)
        if nc_count is MULTICORE:
            block = tuple(range(n))
        else:
            count = max(nc_count, 1)
            start = start_nc if start_nc >= 0 else _least_used(usage)
            block = tuple((start + i) % n for i in range(count))
            _book["next"] = (block[-1] + 1) % n
        for core in block:
            usage[core] += 1
        return block


def _least_used(usage: list) -> int:
    n = len(usage)
    first = _book["next"] % n
    order = [(first + i) % n for i in range(n)]
    return min(order, key=lambda core: usage[core])   # min keeps the first of equals


def release(block: Tuple[int, ...]) -> None:
    """Uncount a block given by :func:`choose` (stale after a runtime restart: ignored)."""
    if not block:
        return
    with _lock:
        if _book["runtime"] is None or _book["runtime"] is not _runtime._runtime:
            return   # counted under a runtime that is gone
        usage = _book["usage"]
        for core in block:
            if core < len(usage) and usage[core] > 0:
                usage[core] -= 1


def usage() -> Tuple[int, ...]:
    """How many loaded models use each visible core, by local index."""
    with _lock:
        return tuple(_usage())


def current_request() -> Tuple[int, int]:
    """(start_nc, nc_count) for a model created now: the active context, or the default."""
    return _request if _request is not None else (-1, -1)


@contextlib.contextmanager
def _requesting(request: Tuple[int, int]) -> Iterator[None]:
    global _request
    previous, _request = _request, request
    try:
        yield
    finally:
        _request = previous
