"""Which aten ops ran on the device and which would have fallen back to the CPU on
TorchNeuron (``torch_neuronx.get_executed_ops`` / ``get_fallback_ops``).

    configure()  at registration: TorchNeuron's device kernels (coverage.DEVICE_OPS,
                 derived from its source by tools/opcoverage.py) go to the C++ half
    an op on neuron tensors ──▶ csrc/optrack.h records it once per clear:
          TorchNeuron has a device kernel for it ──▶ executed, under the name
                                                     TorchNeuron records ("aten::add.Tensor")
          it has none                            ──▶ fallback ("aten::triu", as torch
                                                     names the overload)
          a view TorchNeuron's fallback runs silently, a kernel that records nothing
                                                 ──▶ neither
    clear_op_tracking() empties both; the lists are sets, in no particular order.

Only the outermost op is recorded: a composite device kernel (``linear``, ``_to_copy``)
is one op on TorchNeuron, so the ops torch composes it from are not listed.  The
device kernels written here in Python (``linear_backward``, SyncBatchNorm's, the fused
RMSNorm's) are wrapped by :func:`device_kernel` to the same end.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, FrozenSet, List, TypeVar

F = TypeVar("F", bound=Callable)


def _c():
    from . import device

    return device._c()


def device_kernels() -> Dict[str, object]:
    """``aten::name.overload`` -> the name TorchNeuron records it under (None: nothing)."""
    from .coverage import DEVICE_OPS, RECORDED_AS

    return {name: RECORDED_AS.get(name, name) for name in DEVICE_OPS}


def device_overloads() -> FrozenSet[str]:
    """The ``aten::name.overload`` ops TorchNeuron registers device kernels for."""
    from .coverage import DEVICE_OPS

    return DEVICE_OPS


def configure(ext) -> None:
    """Hand TorchNeuron's device kernels to the extension ``ext`` (at registration)."""
    from .coverage import UNRECORDED_FALLBACK

    ext.optrack_configure({k: v or "" for k, v in device_kernels().items()},
                          sorted(UNRECORDED_FALLBACK))


def device_kernel(op_name: str) -> Callable[[F], F]:
    """Decorate a device kernel written in Python (``op_name``: ``aten::name.overload``):
    each call is recorded as that op, even when another kernel called it (on TorchNeuron
    every such kernel is reached through the dispatcher), and the ops its body runs are
    not, since on TorchNeuron the kernel is one compiled op."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def kernel(*args, **kwargs):
            c = _c()
            c.optrack_enter(op_name)
            try:
                return fn(*args, **kwargs)
            finally:
                c.optrack_leave()
        return kernel   # type: ignore[return-value]
    return wrap


def record_executed(op_name: str) -> None:
    _c().optrack_record(str(op_name), True)


def record_fallback(op_name: str) -> None:
    _c().optrack_record(str(op_name), False)


def get_executed_ops() -> List[str]:
    """The ops run on the device since the last :func:`clear_op_tracking`."""
    return list(_c().optrack_list(True))


def get_fallback_ops() -> List[str]:
    """The ops that fell back to the CPU since the last :func:`clear_op_tracking`."""
    return list(_c().optrack_list(False))


def clear_op_tracking() -> None:
    """Forget every op recorded so far."""
    _c().optrack_clear()
