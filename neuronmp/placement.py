"""The NeuronCore placement API of the Neuron SDK: move or replicate traced models.

``set_neuron_cores`` / ``set_multicore`` re-place models already loaded;
``neuron_cores_context`` / ``multicore_context`` place the models traced or
loaded with ``torch.jit.load`` inside them.  Indexes are relative to the cores
visible to this process (``nc:0`` first); the bookkeeping is the session's
(coreuse.Book), the placement contexts are coreuse's.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from .session import model as _model
from .session import session as _session
from .session.coreuse import MULTICORE, _requesting, validate

__all__ = ["set_neuron_cores", "set_multicore", "neuron_cores_context", "multicore_context"]


def set_neuron_cores(trace: Any, start_nc: int = -1, nc_count: int = -1) -> None:
    """Place every neuronmp subgraph of ``trace`` on ``nc_count`` cores from ``start_nc``.

    ``start_nc=-1`` picks the least-used core; ``nc_count=-1`` means one core; a count
    above one replicates the model and calls go round robin over the copies.  The
    model is unloaded from its current cores first.  Modules without neuronmp
    subgraphs are left alone, as in the SDK.

        model = torch.jit.load("model.pt")
        neuronmp.set_neuron_cores(model, start_nc=2, nc_count=2)   # nc:2, nc:3, nc:2, ...
    """
    validate(start_nc, nc_count, _visible())
    for model in _model.models_in(trace):
        model.place(start_nc, nc_count)


def set_multicore(trace: Any) -> None:
    """Replicate every neuronmp subgraph of ``trace`` on all visible cores (round robin).

        model = torch.jit.load("model.pt")
        neuronmp.set_multicore(model)      # nc:0, nc:1, nc:2, ... per call
    """
    for model in _model.models_in(trace):
        model.place(-1, MULTICORE)


@contextlib.contextmanager
def neuron_cores_context(start_nc: int = -1, nc_count: int = -1) -> Iterator[None]:
    """Place models traced or loaded with ``torch.jit.load`` inside the block.

        with neuronmp.neuron_cores_context(start_nc=0, nc_count=1):
            model = torch.jit.load("model.pt")                  # runs on nc:0
    """
    validate(start_nc, nc_count, _visible())
    with _requesting((start_nc, nc_count)):
        yield


@contextlib.contextmanager
def multicore_context() -> Iterator[None]:
    """Replicate models traced or loaded inside the block on all visible cores.

        with neuronmp.multicore_context():
            model = torch.jit.load("model.pt")                  # round robin over all
    """
    _visible()   # the runtime must be up: the SDK raises RuntimeError here otherwise
    with _requesting((-1, MULTICORE)):
        yield


def _visible() -> int:
    """How many NeuronCores this process sees (starting the runtime if needed)."""
    return len(_session.current().cores)
