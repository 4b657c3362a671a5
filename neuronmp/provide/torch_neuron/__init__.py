"""``torch_neuron`` (the Inf1 generation) as neuronmp provides it
(``NEURONMP_PROVIDE=torch_neuron``): importing it registers ``torch.neuron``.

    import torch, torch_neuron
    model_neuron = torch.neuron.trace(model, example, dynamic_batch_size=True)
    model_parallel = torch.neuron.DataParallel(model_neuron)
    model_parallel.disable_dynamic_batching()

``trace`` takes torch-neuron's keywords (``dynamic_batch_size``, ``fallback``,
``minimum_segment_size``, ``optimizations``, ``compiler_timeout``,
``subgraph_builder_function``, ``compiler_workdir``, ``compiler_args``) and the
``torch.jit.trace`` ones it forwards (``strict``, ``check_trace``, ``check_inputs``,
``check_tolerance``); see :func:`neuronmp.trace` for which of them act here.
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import torch

import neuronmp
from neuronmp import parallel as _parallel
from neuronmp.tracing import trace

__version__ = f"neuronmp-{neuronmp.__version__}"
__all__ = ["trace", "DataParallel"]


class DataParallel(_parallel.DataParallel):
    """``torch.neuron.DataParallel(model, device_ids=None, dim=0)``: dynamic batching is on
    for ``dim=0``; turn it off with :meth:`disable_dynamic_batching`."""

    def __init__(self, model: torch.nn.Module, device_ids: Optional[Sequence[Any]] = None,
                 dim: int = 0):
        super().__init__(model, device_ids=device_ids, dim=dim)


if torch._C._get_privateuse1_backend_name() == "neuron":
    # the native device's module is torch.neuron (NEURONMP_PROVIDE=torchneuron)
    from neuronmp.errors import ProvideConflictError
    from neuronmp.host import settings

    raise ProvideConflictError("NEURONMP_PROVIDE", ",".join(settings.get("provide")),
                               ("torch_neuron", "torchneuron"), "both claim torch.neuron")
torch.neuron = sys.modules[__name__]
sys.modules.setdefault("torch.neuron", sys.modules[__name__])
