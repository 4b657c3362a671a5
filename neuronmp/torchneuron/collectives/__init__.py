"""The ``neuron`` process group: torch.distributed on neuron tensors.

    torchneuron.register() ─▶ register() here: dist.Backend "neuron" (devices=["neuron"])
    dist.init_process_group("neuron") ─▶ _create(): the rank rules, then
        group.ProcessGroupNeuron ─▶ shm.ShmGroup (one host; its arrivals: arrivals.py)
                                    | gloo (several hosts)

The rank rules are TorchNeuron's, applied by a process's first group: each rank owns
one logical core.  The local rank and local world size are LOCAL_RANK and
LOCAL_WORLD_SIZE, or without both the job's ranks on this host in rank order;
NEURON_RT_VISIBLE_CORES is set to the local rank unless the user (or neuronmp-run,
which slices the cores itself) set it, and a set value is left exactly as it is;
``torch.neuron.device_count()`` is the local world size and this rank's tensors live
on ``neuron:<local rank>``; any other index is refused.  Later groups (subgroups,
device meshes) may be made at any time.  See
docs/guides/torchneuron-distributed.md.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Tuple

_registered = False
_HOST_KEY = "nmp_local_host"
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


def _local(store, rank: int, size: int, timeout: timedelta) -> Tuple[int, int]:
    """This rank's local rank and local world size: LOCAL_RANK and LOCAL_WORLD_SIZE when
    both are set (torchrun), else, as TorchNeuron derives them, from the ranks of the
    job on this host in rank order (every rank posts its host in the group's store)."""
    from ...host import settings

    share = settings.get("local_share")
    if share is not None:
        return share
    store.set(f"{_HOST_KEY}/{rank}", socket.gethostname())
    keys = [f"{_HOST_KEY}/{r}" for r in range(size)]
    store.wait(keys, timeout)
    host = socket.gethostname().encode()
    here = [r for r, k in enumerate(keys) if store.get(k) == host]
    return here.index(rank), len(here)


def apply_rank_rules(store, rank: int, size: int, timeout: timedelta) -> int:
    """Pin this process to its rank's core and device index; its local rank.

    The first group of a process (init_process_group's) applies them; later groups
    (``new_group``, a DeviceMesh's) are made over the same device, at any time."""
    from ...host import settings, visibility
    from .. import device

    attached = device.attached_rank()
    if attached is not None:
        return attached
    if device.is_initialized():
        raise AssertionError(_RUNTIME_STARTED)
    local_rank, local_world = _local(store, rank, size, timeout)
    visible = settings.get("visible_cores")
    if visible is None:
        # the device this process starts reads it: the environment is its input
        os.environ[visibility.ENV_VISIBLE] = str(local_rank)
        visible = (local_rank,)
    if len(visible) == 1:
        # the rank's own core, set by the user or just above: left exactly as set (as
        # TorchNeuron's backend does), so the runtime must not narrow it again
        os.environ.setdefault(visibility.ENV_SLICED_BY, "neuron-process-group")
    # several cores: the job's, each rank narrowing to its share (neuronmp's torchrun
    # rule, which neuronmp-run's multi-host path relies on), else one-core-per-rank fails
    device.attach_rank(local_rank, local_world)
    return local_rank


def _create(store, rank: int, size: int, timeout: timedelta):
    from .group import ProcessGroupNeuron

    apply_rank_rules(store, rank, size, timeout)
    return ProcessGroupNeuron(store, rank, size, timeout)
