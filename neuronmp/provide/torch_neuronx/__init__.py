"""``torch_neuronx`` as neuronmp provides it (``NEURONMP_PROVIDE=torch_neuronx``).

Code written for torch-neuronx runs unchanged: ``trace`` (with the SDK's keywords),
``dynamic_batch``, ``DataParallel``, ``lazy_load``, ``async_load``,
``move_trace_to_device``, ``replace_weights``, ``analyze``, and the placement functions
both here (SDK 2.25+) and under ``torch_neuronx.experimental``.  Importing it also sets
``torch.neuronx`` (the SDK's trace page calls ``torch.neuronx.trace``).
"""
from __future__ import annotations

import sys

import torch

import neuronmp
from neuronmp.analysis import analyze
from neuronmp.loading import async_load, lazy_load, move_trace_to_device, replace_weights
from neuronmp.parallel import DataParallel
from neuronmp.placement import (
    multicore_context,
    neuron_cores_context,
    set_multicore,
    set_neuron_cores,
)
from neuronmp.tracing import dynamic_batch, trace

from . import experimental

__version__ = f"neuronmp-{neuronmp.__version__}"
__all__ = ["trace", "dynamic_batch", "DataParallel", "lazy_load", "async_load",
           "move_trace_to_device", "replace_weights", "analyze", "set_neuron_cores",
           "set_multicore", "neuron_cores_context", "multicore_context", "experimental"]

torch.neuronx = sys.modules[__name__]
sys.modules.setdefault("torch.neuronx", sys.modules[__name__])
