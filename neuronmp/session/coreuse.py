"""Core usage bookkeeping: which of this process's cores each traced model occupies.

A :class:`Book` per runtime (its session owns it): how many models use each
visible core (local index).

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
The public placement API (placement.py) sits above the models (model.py) and
drives this; a model asks its session's book where it goes.  The placement
contexts are, as in the SDK, process-wide and not thread-safe.  Imports no torch.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional, Tuple


class _AllCores:
    """The internal nc_count of set_multicore / multicore_context: every visible core."""

    def __repr__(self) -> str:
        return "MULTICORE"


MULTICORE: Any = _AllCores()

_request: Optional[Tuple[int, int]] = None


def validate(start_nc: int, nc_count: int, visible: int) -> None:
    """Raise ValueError, with the SDK's wording, for a placement that cannot be honoured."""
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


class Book:
    """How many models use each of one runtime's cores (by local index); owned by its
    session, so a new runtime starts a new book."""

    def __init__(self, visible: int):
        self.visible = visible
        self._usage = [0] * visible
        self._next = 0
        self._lock = threading.RLock()  # re-entrant: finalizers may run inside it

    def choose(self, start_nc: int = -1, nc_count: int = -1) -> Tuple[int, ...]:
        """Pick and count a block of local cores for one model (validated first)."""
        validate(start_nc, nc_count, self.visible)
        with self._lock:
            usage, n = self._usage, self.visible
            if nc_count is MULTICORE:
                block = tuple(range(n))
            else:
                count = max(nc_count, 1)
                start = start_nc if start_nc >= 0 else self._least_used()
                block = tuple((start + i) % n for i in range(count))
                self._next = (block[-1] + 1) % n
            for core in block:
                usage[core] += 1
            return block

    def take(self, block: Tuple[int, ...]) -> Tuple[int, ...]:
        """Count an exact block again (a model re-loaded under a new runtime)."""
        with self._lock:
            if any(core >= self.visible for core in block):
                raise ValueError(f"placement {list(block)} does not fit the "
                                 f"{self.visible} visible NeuronCore(s)")
            for core in block:
                self._usage[core] += 1
            return block

    def _least_used(self) -> int:
        n, usage = self.visible, self._usage
        first = self._next % n
        order = [(first + i) % n for i in range(n)]
        return min(order, key=lambda core: usage[core])   # min keeps the first of equals

    def release(self, block: Tuple[int, ...]) -> None:
        """Uncount a block given by :meth:`choose`."""
        with self._lock:
            for core in block:
                if core < self.visible and self._usage[core] > 0:
                    self._usage[core] -= 1

    def usage(self) -> Tuple[int, ...]:
        """How many loaded models use each visible core, by local index."""
        with self._lock:
            return tuple(self._usage)


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
