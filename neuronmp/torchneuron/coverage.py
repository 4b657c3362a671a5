"""The aten ops TorchNeuron registers a device kernel for (generated: tools/opcoverage.py)."""
from __future__ import annotations

DEVICE_OPS: frozenset = frozenset()
