"""TorchNeuron's native ``neuron`` device on an emulated host (``NEURONMP_PROVIDE=torchneuron``).

    import torch ─▶ entry point group "torch.backends" (_neuronmp_provide.autoload_torch:
    │               nothing unless NEURONMP_PROVIDE asks for torchneuron)
    import torch_neuronx (the native stand-in, neuronmp/provide/torchneuron)
    └─▶ register():
          _ext.load()                 the C++ half: guard, allocator, hooks, kernels,
                                      the CPU fallback, autocast (compiled once per user)
          PrivateUse1 renamed "neuron", tensor/module/storage methods (.neuron())
          torch.neuron = device       (device.py: device_count ... memory_stats)
          fused LSTM / GRU cell kernels (rnn.py: what nn.LSTM / nn.GRU call)
          SyncBatchNorm's kernels, linear_backward (syncbn.py)
          rms_norm and its fused kernels, as TorchNeuron's (rmsnorm.py)
          DTensor's sharding rule for linear_backward (sharding.py)
          the runtime starts lazily   (first device use: device._lazy_init)
    torch.compile(backend="neuron") ─▶ backend.neuron_backend (entry point group
                                      "torch_dynamo_backends"): the graph runs on its
                                      core's worker through the one request path

Device ``neuron:i`` is the process's i-th visible logical core, as the runtime numbers
them (NEURON_RT_VISIBLE_CORES / NEURON_RT_NUM_CORES / NEURON_LOGICAL_NC_CONFIG).
Eager ops run the CPU's kernels on the same host memory; see docs/guides/torchneuron.md
for what is and is not emulated.
"""
from __future__ import annotations

import sys
import threading

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Register the ``neuron`` device with torch (idempotent)."""
    global _registered
    with _lock:
        if _registered:
            return
        import os

        import torch

        from ..errors import NeuronmpError
        from . import _ext, device

        c = _ext.load()
        try:
            count = device.visible_count()
        except NeuronmpError:
            count = 0   # a bad NEURON_RT_* value: raised at device_count / first use
        c.setup(count, device._lazy_init)
        from ..host import settings

        # Trainium's refusals and numerics unless the user asked for the CPU's
        c.set_relaxed(settings.get("torchneuron_relaxed"))
        from . import optrack, rmsnorm

        rmsnorm.register()       # before op tracking, which leaves registered kernels be
        optrack.configure(c)     # TorchNeuron's device kernels: what counts as executed
        # TorchNeuron's registration turns its torch-mlir lowering on unless the user
        # set it: code reading the switch (torch_neuronx.utils) branches as on hardware
        os.environ.setdefault("TORCH_NEURONX_MLIR_ATEN_OPS", "1")
        device._ext_module = c
        if torch._C._get_privateuse1_backend_name() != "neuron":
            torch.utils.rename_privateuse1_backend("neuron")
        torch.utils.generate_methods_for_privateuse1_backend(
            for_tensor=True, for_module=True, for_storage=True)
        device.memory = device
        torch._register_device_module("neuron", device)
        sys.modules.setdefault("torch.neuron.memory", device)
        from . import collectives, rnn, syncbn

        rnn.register()           # the fused LSTM / GRU cells, CUDA-only in PyTorch
        syncbn.register()        # SyncBatchNorm's kernels (CUDA-only), linear_backward
        collectives.register()   # TorchNeuron registers its backend with its device
        from . import sharding

        sharding.register()      # DTensor's rule for linear_backward, as TorchNeuron's
        # the runtime's start-up (first device use) takes its allocation lock through
        # filelock: imported here, a child forked after registration (pytest --forked,
        # one test per child) does not import it again at its first tensor
        import filelock  # noqa: F401
        _registered = True


def is_registered() -> bool:
    return _registered
