"""Checks shared by the SDK-shaped calls (trace, analyze, the loading API, DataParallel).

They raise where the caller made the mistake, in the SDK's words, and their warnings
point at the caller's line rather than at neuronmp's.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Tuple

import torch

# Where a warning must not point: this package (its provided aliases included) and
# torch.nn.Module.__call__'s module, which sits between a user's line and forward.
_INTERNAL = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
             os.path.abspath(torch.nn.modules.module.__file__))


def caller_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, called from the warning function, that names the
    first frame outside neuronmp and torch.nn's call machinery: the user's line,
    however the call got here (Python 3.11 has no ``skip_file_prefixes``)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


def check_bool(where: str, name: str, value: Any) -> None:
    """``neuronmp.<where>``'s flag ``name`` must be a real bool, not merely truthy."""
    if not isinstance(value, bool):
        raise TypeError(f"neuronmp.{where}: {name} must be True or False, got {value!r}")


def example_tuple(example_inputs: Any) -> Tuple[torch.Tensor, ...]:
    """The SDK's ``example_inputs`` (a tensor or a non-empty tuple of CPU tensors) as a
    tuple."""
    items = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    if not isinstance(items, (tuple, list)) or not items:
        raise TypeError(
            "neuronmp.trace: example_inputs must be a tensor or a non-empty tuple of "
            f"tensors, got {type(example_inputs).__name__}"
        )
    for i, x in enumerate(items):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"neuronmp.trace: example input {i} must be a torch.Tensor, "
                            f"got {type(x).__name__}")
        if x.device.type != "cpu":
            raise ValueError(f"neuronmp.trace: example input {i} is on {x.device}; "
                             "traced models consume CPU tensors")
    return tuple(items)
