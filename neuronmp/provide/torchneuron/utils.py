"""``torch_neuronx.utils`` as TorchNeuron users call it: its settings switches (each
reads the variable TorchNeuron reads, at the call), the host's platform facts
(from the emulated topology) and its small tensor helpers.

    use_mlir_aten_ops()        TORCH_NEURONX_MLIR_ATEN_OPS == "1"
    is_stablehlo_enabled()     TORCH_NEURONX_ENABLE_STABLEHLO not "0"/"false"
    is_sync_mode_enabled()     NEURON_LAUNCH_BLOCKING == "1"
    get_platform_target()      "trn1" / "trn2" / "trn3" / "inf2", from NEURONMP_TOPOLOGY
    get_worker_multiplier()    2 on a trn2 host at logical core size 1, else 1
    get_neuron_registered_ops()  the aten ops with a kernel for the device

The emulation runs every op synchronously whatever NEURON_LAUNCH_BLOCKING says; the
switch is read so that code branching on it takes the branch it takes on hardware.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, List, Optional, Set, Union

import torch
from packaging.version import Version

from neuronmp.torchneuron import optrack as _optrack

TORCH_VERSION = Version(torch.__version__)

#: instance families TorchNeuron tells apart, by the instance name's prefix
_FAMILIES = ("trn1", "trn2", "trn3", "inf2")


def _setting(name: str):
    # TorchNeuron reads its switches at each call: these are the settings' live fields
    from neuronmp.host import settings

    return settings.get(name)


def use_mlir_aten_ops() -> bool:
    """Whether eager ops lower through torch-mlir (``TORCH_NEURONX_MLIR_ATEN_OPS=1``)."""
    return _setting("mlir_aten_ops")


def is_stablehlo_enabled() -> bool:
    """Whether lowering goes through StableHLO (on unless the variable is "0"/"false")."""
    return _setting("stablehlo")


def is_sync_mode_enabled() -> bool:
    """Whether launches block (``NEURON_LAUNCH_BLOCKING=1``)."""
    return _setting("launch_blocking")


def skip_op_preconditions() -> bool:
    """Whether op precondition checks are skipped (``TORCH_NEURONX_SKIP_OP_PRECONDITIONS=1``)."""
    return _setting("skip_op_preconditions")


def is_neff_cache_disabled() -> bool:
    """Whether ``TORCH_NEURONX_DISABLE_NEFF_CACHE`` is "1", "true" or "yes"."""
    return _setting("neff_cache_disabled")


def get_gmm_align() -> int:
    """Grouped-matmul offset alignment (``TORCH_NEURONX_ATEN_GMM_ALIGN``, default 128)."""
    return _setting("gmm_align")


def _topology():
    return _setting("topology")


def get_instance_type() -> str:
    """The emulated instance type (``NEURONMP_TOPOLOGY``'s preset name, or the grid's)."""
    return _topology().name


def get_platform_target() -> str:
    """The chip generation: the preset's family; a grid host (no preset) is trn2-like
    when it accepts logical core size 2, trn1-like otherwise."""
    topo = _topology()
    for family in _FAMILIES:
        if topo.name.startswith(family):
            return family
    return "trn2" if 2 in topo.lnc_choices else "trn1"


def get_lnc_setting() -> str:
    """The host's logical core size, as a string (TorchNeuron's form)."""
    return str(_topology().lnc)


def get_logical_neuron_cores() -> str:
    """The logical core size (``NEURON_LOGICAL_NC_CONFIG`` if set, else the host's),
    as a string: the topology field holds the checked value either way."""
    return get_lnc_setting()


def get_worker_multiplier() -> int:
    """2 on a trn2 host at logical core size 1 (twice the workers per chip), else 1."""
    return 2 if get_platform_target() == "trn2" and get_logical_neuron_cores() == "1" else 1


def is_float8_e4m3_supported() -> bool:
    return get_platform_target() == "trn2"


def is_float8_e4m3fn_supported() -> bool:
    return get_platform_target() != "trn2"


def is_mxocp_supported() -> bool:
    return get_platform_target() != "trn2"


def get_neuron_registered_ops(as_sorted: bool = False,
                              keep_variant: bool = False) -> Union[Set[str], List[str]]:
    """The aten ops TorchNeuron has a device kernel for, without the ``aten::`` prefix
    (``"add"``; with ``keep_variant``, ``"add.Tensor"``)."""
    names = {n.split("::", 1)[1] for n in _optrack.device_overloads()}
    if not keep_variant:
        names = {n.split(".")[0] for n in names}
    return sorted(names) if as_sorted else names


def log_executed_op(op_name: str) -> None:
    """Record ``op_name`` as run on the device (what ``get_executed_ops`` lists)."""
    _optrack.record_executed(op_name)


def log_offloaded_op(op_name: str) -> None:
    """Record ``op_name`` as fallen back to the CPU (what ``get_fallback_ops`` lists)."""
    _optrack.record_fallback(op_name)


def flatten_tensors(obj: Any) -> List[torch.Tensor]:
    """Every tensor in a nest of lists and tuples, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in flatten_tensors(item)]
    return []


def get_device_from_tensors(tensors: Any) -> torch.device:
    """The first tensor's device, or the current neuron device when there is none."""
    found = flatten_tensors(tensors)
    if found:
        return found[0].device
    return torch.device("neuron", torch.neuron.current_device())


def move_pytree_to_cpu(obj: Any) -> Any:
    """``obj`` with every neuron tensor in it (lists, tuples, dicts) copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.to("cpu") if obj.device.type == "neuron" else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_pytree_to_cpu(x) for x in obj)
    if isinstance(obj, dict):
        return {k: move_pytree_to_cpu(v) for k, v in obj.items()}
    return obj


def move_pytree_to_neuron(obj: Any) -> Any:
    """``obj`` with every tensor in it (lists, tuples, dicts) moved to the neuron device."""
    if isinstance(obj, torch.Tensor):
        return obj.to("neuron")
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_pytree_to_neuron(x) for x in obj)
    if isinstance(obj, dict):
        return {k: move_pytree_to_neuron(v) for k, v in obj.items()}
    return obj


def cast_dtype_if_needed(tensor: torch.Tensor, target_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``tensor`` in ``target_dtype`` (itself when that is None or already its dtype)."""
    if target_dtype is None or tensor.dtype == target_dtype:
        return tensor
    return tensor.to(dtype=target_dtype)


@contextmanager
def suppress_specific_warnings(patterns: Iterable[str]) -> Iterator[None]:
    """Hide warnings whose message contains any of ``patterns`` inside the block."""
    patterns = list(patterns)
    original = warnings.showwarning

    def _show(message, category, filename, lineno, file=None, line=None):
        if not any(p in str(message) for p in patterns):
            original(message, category, filename, lineno, file, line)

    warnings.showwarning = _show
    try:
        yield
    finally:
        warnings.showwarning = original
