"""``torch_neuronx`` as TorchNeuron (the native ``neuron`` device) has it, provided by
neuronmp (``NEURONMP_PROVIDE=torchneuron``): importing it registers the device.

    import torch, torch_neuronx          # torch alone registers it too (autoload)
    x = torch.randn(8, 16, device="neuron")
    torch_neuronx.current_device(), torch.neuron.device_count()

The device functions (``device_count``, ``set_device``, ``synchronize``, the memory
statistics, seeds, ``Stream``/``Event`` ...) are ``torch.neuron``'s, also exported
here as TorchNeuron's package exports them.  See docs/guides/torchneuron.md.
"""
from __future__ import annotations

import importlib as _importlib
import sys as _sys

# torch first: its autoload registers the device, which imports neuronmp's device
# module; importing that module first would make it a partial module at that point
import torch as _torch

import neuronmp
from neuronmp.torchneuron import device as _device
from neuronmp.torchneuron import optrack as _optrack
from neuronmp.torchneuron import register as _register

_register()

__version__ = f"neuronmp-{neuronmp.__version__}"
__all__ = [n for n in dir(_device) if not n.startswith("_") and callable(getattr(_device, n))
           and getattr(getattr(_device, n), "__module__", "") == _device.__name__]
globals().update({n: getattr(_device, n) for n in __all__})
_lazy_init = _device._lazy_init
_is_in_bad_fork = _device._is_in_bad_fork

# torch.neuron is torch_neuronx.neuron, one module, as on hardware
neuron = _device
_sys.modules.setdefault(__name__ + ".neuron", _device)
is_neuron_runtime_initialized = _device.is_initialized
get_executed_ops = _optrack.get_executed_ops
get_fallback_ops = _optrack.get_fallback_ops
clear_op_tracking = _optrack.clear_op_tracking
__all__ += ["neuron", "is_neuron_runtime_initialized", "get_executed_ops", "get_fallback_ops",
            "clear_op_tracking", "utils"]

from . import utils  # noqa: E402  (after the device is registered: it reads torch.neuron)

# TorchNeuron's import loads DTensor (its distributed package registers DTensor sharding
# rules).  Loaded here too, a process forked after `import torch_neuronx` (pytest
# --forked runs each test in one) finds it loaded, as on hardware, instead of importing
# it (and sympy) in every child at its first torch.testing.assert_close, which unwraps
# DTensors whenever torch.distributed is available.
if _torch.distributed.is_available():
    _importlib.import_module("torch.distributed.tensor")


def _autoload() -> None:
    """TorchNeuron's entry point name: the device is registered at import."""
