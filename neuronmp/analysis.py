"""``neuronmp.analyze``: the SDK's operator-support report for a function or module.

The SDK checks every operator of the traced graph against its compiler.  A neuronmp
core runs whatever ``torch.jit.trace`` recorded, so the report lists every operator
(with its count) as supported, in the SDK's shape:

    {"torch_neuronx_version": ..., "neuronx_cc_version": ..., "support_percentage": "100.00%",
     "supported_operators": {"aten::linear": 3, ...}, "unsupported_operators": []}

An operator that cannot be traced makes ``torch.jit.trace`` raise, as it makes the
SDK's analyze raise.
"""
from __future__ import annotations

import collections
import json
import os
import shutil
import warnings
from typing import Any, Dict, Iterable, Optional, Sequence, Union

import torch

from .host import _torchscript
from .session import pytree
from .session import sdkargs as _sdkargs

__all__ = ["analyze"]

#: node kinds that are graph plumbing (constants, tuples, attribute reads), not operators
_PLUMBING = "prim::"


def analyze(
    func: Any,
    example_inputs: Union[torch.Tensor, Sequence[torch.Tensor]],
    compiler_workdir: Optional[Union[str, os.PathLike]] = None,
    additional_ignored_ops: Iterable[str] = frozenset(),
    max_workers: int = 4,
    is_hf_transformers: bool = False,
    cleanup: bool = False,
) -> Dict[str, Any]:
    """The operator-support report of ``func`` traced on ``example_inputs`` (a dict).

    ``additional_ignored_ops`` (a set of names such as ``"aten::relu"``) are left out of
    the report; ``compiler_workdir`` receives ``analyze.json`` (the report), removed
    again with ``cleanup=True``.  ``max_workers`` and ``is_hf_transformers`` steer the
    SDK's per-operator compile threads, which neuronmp does not have: checked, and
    named in a warning when not the default.
    """
    inputs = _sdkargs.example_tuple(example_inputs)
    if not callable(func):
        raise TypeError(f"neuronmp.analyze: func must be a torch.nn.Module or a callable, "
                        f"got {type(func).__name__}")
    ignored = _ignored_ops(additional_ignored_ops)
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        raise ValueError(f"neuronmp.analyze: max_workers must be an int >= 1, got {max_workers!r}")
    _sdkargs.check_bool("analyze", "is_hf_transformers", is_hf_transformers)
    _sdkargs.check_bool("analyze", "cleanup", cleanup)
    unused = [name for name, value, default in (("max_workers", max_workers, 4),
              ("is_hf_transformers", is_hf_transformers, False)) if value != default]
    if unused:
        warnings.warn(f"neuronmp.analyze: {', '.join(unused)} accepted, but no effect here "
                      "(operators are not compiled one by one)",
                      stacklevel=_sdkargs.caller_stacklevel())
    report = _report(_operators(func, inputs, ignored))
    if compiler_workdir is not None:
        _write(compiler_workdir, report, cleanup)
    return report


def _ignored_ops(ops: Any) -> frozenset:
    if isinstance(ops, (str, bytes)) or not isinstance(ops, Iterable):
        raise TypeError(f"neuronmp.analyze: additional_ignored_ops must be a set of operator "
                        f"names such as 'aten::relu', got {ops!r}")
    ops = frozenset(ops)
    bad = [op for op in ops if not isinstance(op, str)]
    if bad:
        raise TypeError(f"neuronmp.analyze: additional_ignored_ops holds {bad[0]!r}; "
                        "expected operator names such as 'aten::relu'")
    return ops


def _operators(func: Any, inputs: tuple, ignored: frozenset) -> Dict[str, int]:
    with torch.no_grad():
        spec = pytree.spec_of(func(*inputs))
        with _torchscript.quiet():
            traced = torch.jit.trace(pytree.FlatOutputs(func, spec), inputs, check_trace=False)
    graph = traced.inlined_graph
    counts: Dict[str, int] = collections.Counter(
        node.kind() for node in graph.nodes()
        if not node.kind().startswith(_PLUMBING) and node.kind() not in ignored)
    return dict(sorted(counts.items()))


def _report(supported: Dict[str, int]) -> Dict[str, Any]:
    from . import __version__

    return {
        "torch_neuronx_version": f"{torch.__version__} (neuronmp {__version__})",
        "neuronx_cc_version": f"none (neuronmp {__version__} runs TorchScript on CPU workers)",
        "support_percentage": "100.00%",
        "supported_operators": supported,
        "unsupported_operators": [],
    }


def _write(workdir: Union[str, os.PathLike], report: Dict[str, Any], cleanup: bool) -> None:
    path = os.fspath(workdir)
    existed = os.path.isdir(path)
    os.makedirs(path, exist_ok=True)
    target = os.path.join(path, "analyze.json")
    with open(target, "w") as f:
        json.dump(report, f, indent=2)
    if cleanup:
        os.remove(target)
        if not existed:
            shutil.rmtree(path, ignore_errors=True)
