"""neuronmp: the Neuron SDK's multi-core programming model, on any Linux host.

``import neuronmp`` is cheap: topology, visibility, reservations and the
command-line tools import no torch.  The torch-based API (``trace``,
``DataParallel``, the placement functions) is loaded on first attribute access.

    import neuronmp
    neuronmp.visible_cores()     # global ids of this process's cores, ascending
    neuronmp.core_count()        # how many, like torch.cuda.device_count()

``__all__`` is the public API: the Neuron SDK's names (``trace``, ``DataParallel``,
``set_neuron_cores`` ...), the runtime's (``init``, ``visible_cores`` ...) and the
error classes.  ``from neuronmp import *`` loads the torch-based ones (it names
them); the submodules ``experimental``, ``batching`` and ``serve`` stay attributes.
"""
from __future__ import annotations

import importlib
import sys
from typing import Tuple

from .errors import (  # noqa: F401  (re-exported)
    BatchBucketsError,
    CollectiveMismatchError,
    CollectiveOpError,
    CollectiveRankDiedError,
    CollectiveTimeoutError,
    CollectiveUsageError,
    CompileOptionError,
    ConfigError,
    CoreUnavailableError,
    DeviceExtensionError,
    DeviceIdError,
    ExecTimeoutError,
    ExtensionCacheError,
    ModelError,
    MonitorConfigError,
    NeuronForkError,
    NeuronmpError,
    PeerDiedError,
    PoolClosedError,
    ProvideConflictError,
    ProvideError,
    QueueFullError,
    RemoteTraceback,
    RequestTimeoutError,
    RuntimeDirError,
    ServerClosedError,
    ShmSpaceError,
    TopologyError,
    UnsafeDirectoryError,
    VisibilityError,
    WeightWriteError,
    WorkerDiedError,
    WorkerPackageError,
)

__version__ = "0.1.0"


def visible_cores() -> Tuple[int, ...]:
    """The instance-wide ids of the NeuronCores this process owns, ascending."""
    from .host import runtime

    return tuple(runtime.visible_cores())


def core_count() -> int:
    """How many NeuronCores this process sees (``nc:0`` .. ``nc:{n-1}``)."""
    return len(visible_cores())


# name -> module that defines it; loaded lazily so torch is imported only when needed
_LAZY = {
    "init": "host.runtime",
    "shutdown": "host.runtime",
    "trace": "tracing",
    "dynamic_batch": "tracing",
    "lazy_load": "loading",
    "async_load": "loading",
    "move_trace_to_device": "loading",
    "replace_weights": "loading",
    "analyze": "analysis",
    "set_neuron_cores": "placement",
    "set_multicore": "placement",
    "neuron_cores_context": "placement",
    "multicore_context": "placement",
    "device_time_context": "host.devicetime",
    "DeviceTime": "host.devicetime",
    "DataParallel": "parallel",
    "record": "launch.errorfile",
    # neuronmp-serve's errors: its package loads only when one is asked for
    "ModelConfigError": "server.errors",
    "InferRequestError": "server.errors",
    "SharedMemoryError": "server.errors",
    "experimental": None,
    "batching": None,
    "serve": None,
}


#: the public API; the torch-based names come from _LAZY on first use
__all__ = [
    "__version__", "visible_cores", "core_count",
    # runtime
    "init", "shutdown",
    # the Neuron SDK's API
    "trace", "dynamic_batch", "lazy_load", "async_load", "move_trace_to_device",
    "replace_weights", "analyze", "set_neuron_cores", "set_multicore",
    "neuron_cores_context", "multicore_context", "device_time_context", "DeviceTime",
    "DataParallel", "record",
    # errors
    "NeuronmpError", "ConfigError", "TopologyError", "VisibilityError", "DeviceIdError",
    "CoreUnavailableError", "RuntimeDirError", "UnsafeDirectoryError", "ShmSpaceError",
    "PeerDiedError", "WorkerDiedError", "WorkerPackageError", "ModelError", "RemoteTraceback",
    "ExecTimeoutError", "WeightWriteError", "BatchBucketsError", "CompileOptionError",
    "PoolClosedError", "QueueFullError", "RequestTimeoutError", "ServerClosedError",
    "ProvideError", "ProvideConflictError", "DeviceExtensionError", "NeuronForkError",
    "ExtensionCacheError", "MonitorConfigError", "CollectiveRankDiedError",
    "CollectiveTimeoutError", "CollectiveUsageError", "CollectiveMismatchError",
    "CollectiveOpError",
    "ModelConfigError", "InferRequestError", "SharedMemoryError",
]


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
    return sorted(set(__all__) | set(_LAZY) | {n for n in globals() if n.startswith("__")})


# -- the neuronmp::forward op must exist before torch.jit.load reads a traced model ----------


class _RegisterOpsAfterTorch:
    """Import hook: once ``torch`` has been imported, register neuronmp's TorchScript ops.

    ``import neuronmp`` must not import torch, yet a saved traced model has to load
    with plain ``torch.jit.load`` afterwards; so the ops are registered right after
    torch finishes importing (or at once, when it already has).
    """

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        import importlib.util

        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec = importlib.util.find_spec("torch")
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister:
    """A loader that runs torch's own loader, then registers the ops."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _register_ops()

    def __getattr__(self, name):
        return getattr(self._loader, name)


def _register_ops() -> None:
    try:
        importlib.import_module(".ops", __name__)
    except Exception as exc:  # never break `import torch`; loading a traced model will say why
        import warnings

        warnings.warn(f"neuronmp could not register its TorchScript ops: {exc!r}", stacklevel=2)


if "torch" in sys.modules:
    _register_ops()
elif not any(isinstance(f, _RegisterOpsAfterTorch) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterOpsAfterTorch())


def _catch_sigterm() -> None:
    """SIGTERM shuts the runtime down however it is first used: Python lets only the
    main thread install the handler, and ``import neuronmp`` usually runs there."""
    import threading

    if threading.current_thread() is threading.main_thread():
        from .host import runtime

        runtime.stop_on_sigterm()


_catch_sigterm()
