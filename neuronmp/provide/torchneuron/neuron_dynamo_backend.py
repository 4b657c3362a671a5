"""``torch_neuronx.neuron_dynamo_backend``: the compile backend's public names.

    neuron_backend, create_neuron_backend()   what torch.compile(backend="neuron") runs
    set_model_name / get_model_name           the name TorchNeuron gives a compiled
                                              model's artifacts (kept, not used: the
                                              emulation writes no NEFF files)
    get_rank()                                the distributed rank, else the current device

Its lowering passes (FX to StableHLO, neuronx-cc, NEFF caches) are not emulated.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from neuronmp.torchneuron.backend import neuron_backend

__all__ = ["create_neuron_backend", "get_model_name", "get_rank", "neuron_backend",
           "set_model_name"]

_model_name: Optional[str] = None


def create_neuron_backend() -> Callable:
    """The backend callable ``torch.compile(backend=...)`` accepts."""
    return neuron_backend


def set_model_name(name: str) -> None:
    """Name the model compiled next (TorchNeuron names its NEFF files after it)."""
    if not isinstance(name, str):
        raise TypeError(f"set_model_name expects a str, got {type(name).__name__}: {name!r}")
    global _model_name
    _model_name = name


def get_model_name() -> Optional[str]:
    """The name :func:`set_model_name` set last (None before)."""
    return _model_name


def get_rank() -> int:
    """The distributed rank when a process group is up, else the current neuron device."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return torch.neuron.current_device()
