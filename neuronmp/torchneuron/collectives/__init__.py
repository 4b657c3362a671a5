"""The ``neuron`` process group: torch.distributed on neuron tensors.

    torchneuron.register() ─▶ register() here: dist.Backend "neuron" (devices=["neuron"])
    dist.init_process_group("neuron") ─▶ _create(): the rank rules, then
        group.ProcessGroupNeuron ─▶ shm.ShmGroup (one host) | gloo (several hosts)

The rank rules are TorchNeuron's: each rank owns one logical core.
NEURON_RT_VISIBLE_CORES is set to LOCAL_RANK unless the user (or neuronmp-run,
which slices the cores itself and marks its ranks NEURONMP_SLICED_BY) set it;
``torch.neuron.device_count()`` is LOCAL_WORLD_SIZE and this rank's tensors live
on ``neuron:LOCAL_RANK``; any other index is refused.  See
docs/guides/torchneuron-distributed.md.
"""
from __future__ import annotations

import os
from datetime import timedelta

_registered = False
_RUNTIME_STARTED = "Neuron runtime should not be initialized before the init_process_group"


def register() -> None:
    """Register the ``neuron`` backend with torch.distributed (idempotent)."""
    global _registered
    if _registered:
        return
    import torch.distributed as dist

    if not dist.is_available():
        return
    if "neuron" not in dist.Backend.backend_list:
        dist.Backend.register_backend("neuron", _create, devices=["neuron"])
    _registered = True


def _local() -> tuple:
    from ... import visibility

    rank = os.environ.get(visibility.ENV_LOCAL_RANK)
    size = os.environ.get(visibility.ENV_LOCAL_WORLD_SIZE)
    if rank is None or size is None:
        return 0, 1
    return visibility._local_rank_and_size(rank, size)


def apply_rank_rules() -> int:
    """Pin this process to its rank's core and device index; its LOCAL_RANK."""
    from ... import visibility
    from .. import device

    if device.is_initialized():
        raise AssertionError(_RUNTIME_STARTED)
    local_rank, local_world = _local()
    if visibility.ENV_VISIBLE not in os.environ:
        os.environ[visibility.ENV_VISIBLE] = str(local_rank)
        # taken as this rank's own slice: the runtime must not narrow it again
        os.environ[visibility.ENV_SLICED_BY] = "neuron-process-group"
    device.attach_rank(local_rank, local_world)
    return local_rank


def _create(store, rank: int, size: int, timeout: timedelta):
    from .group import ProcessGroupNeuron

    apply_rank_rules()
    return ProcessGroupNeuron(store, rank, size, timeout)
