"""Which aten ops ran on the device and which would have fallen back to the CPU on
TorchNeuron (``torch_neuronx.get_executed_ops`` / ``get_fallback_ops``).

    an op on neuron tensors ──▶ the C++ dispatch (csrc/neuron.cpp) records its name once
                                 ("aten::add", TorchNeuron's form: no overload)
          has a TorchNeuron device kernel (coverage.DEVICE_OPS)  ──▶ executed
          has none                                               ──▶ fallback
    clear_op_tracking() empties both; the lists are sets, in no particular order.
"""
from __future__ import annotations

import threading
from typing import FrozenSet, List, Set

_lock = threading.Lock()
_executed: Set[str] = set()
_fallback: Set[str] = set()


def device_overloads() -> FrozenSet[str]:
    """The ``aten::name.overload`` ops TorchNeuron registers device kernels for."""
    from .coverage import DEVICE_OPS

    return DEVICE_OPS


def record_executed(op_name: str) -> None:
    with _lock:
        _executed.add(op_name)


def record_fallback(op_name: str) -> None:
    with _lock:
        _fallback.add(op_name)


def get_executed_ops() -> List[str]:
    """The ops run on the device since the last :func:`clear_op_tracking`."""
    with _lock:
        return list(_executed)


def get_fallback_ops() -> List[str]:
    """The ops that fell back to the CPU since the last :func:`clear_op_tracking`."""
    with _lock:
        return list(_fallback)


def clear_op_tracking() -> None:
    """Forget every op recorded so far."""
    with _lock:
        _executed.clear()
        _fallback.clear()
