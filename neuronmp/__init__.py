"""neuronmp: the Neuron SDK's multi-core programming model, on any Linux host.

``import neuronmp`` is cheap: topology, visibility, reservations and the
command-line tools import no torch.  The torch-based API (``trace``,
``DataParallel``, the placement functions) is loaded on first attribute access.

    import neuronmp
    neuronmp.visible_cores()     # global ids of this process's cores, ascending
    neuronmp.core_count()        # how many, like torch.cuda.device_count()
"""
from __future__ import annotations

import importlib
from typing import Tuple

from .errors import (  # noqa: F401  (re-exported)
    CoreUnavailableError,
    DeviceIdError,
    ModelError,
    NeuronmpError,
    PeerDiedError,
    PoolClosedError,
    RuntimeDirError,
    ShmSpaceError,
    TopologyError,
    VisibilityError,
    WorkerDiedError,
)

__version__ = "0.1.0"


def visible_cores() -> Tuple[int, ...]:
    """The instance-wide ids of the NeuronCores this process owns, ascending."""
    from . import runtime

    return tuple(runtime.visible_cores())


def core_count() -> int:
    """How many NeuronCores this process sees (``nc:0`` .. ``nc:{n-1}``)."""
    return len(visible_cores())


# name -> module that defines it; loaded lazily so torch is imported only when needed
_LAZY = {
    "init": "runtime",
    "shutdown": "runtime",
    "trace": "trace",
    "dynamic_batch": "trace",
    "set_neuron_cores": "placement",
    "set_multicore": "placement",
    "neuron_cores_context": "placement",
    "multicore_context": "placement",
    "DataParallel": "parallel",
    "experimental": None,
    "serve": None,
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'neuronmp' has no attribute {name!r}")
    module = _LAZY[name]
    if module is None:
        return importlib.import_module(f".{name}", __name__)
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
