"""The one pytree module: nested outputs and arguments as flat lists of tensors.

A traced model's outputs travel as a flat list of tensors; the *spec* rebuilds
the structure the model returned:

    spec  = leaf index (int)  |  ["tuple" | "list", [spec, ...]]  |  ["dict", [[key, spec], ...]]
    flatten(out, spec) -> [t0, t1, ...]          unflatten([t0, t1, ...], spec) -> out

DataParallel's module-copies path scatters and gathers arbitrary arguments with
torch.nn.DataParallel's rules (:func:`scatter`, :func:`gather`).  The spec is
JSON, so it is stored in a traced model's metadata.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

__all__ = ["spec_of", "flatten", "unflatten", "leaves", "first_tensor", "scatter", "gather"]


def spec_of(out: Any, counter: Optional[List[int]] = None) -> Any:
    """The spec of ``out``: tensors, or non-empty tuples, lists or str-keyed dicts of them."""
    counter = [0] if counter is None else counter
    if isinstance(out, torch.Tensor):
        counter[0] += 1
        return counter[0] - 1
    if isinstance(out, (tuple, list)) and out:
        kind = "tuple" if isinstance(out, tuple) else "list"
        return [kind, [spec_of(o, counter) for o in out]]
    if isinstance(out, dict) and out and all(isinstance(k, str) for k in out):
        return ["dict", [[k, spec_of(v, counter)] for k, v in out.items()]]
    raise TypeError(
        "neuronmp.trace: outputs must be tensors, or non-empty tuples, lists or str-keyed "
        f"dicts of them; got {type(out).__name__}: {out!r:.80}"
    )


def flatten(out: Any, spec: Any) -> List[torch.Tensor]:
    """The tensors of ``out`` in spec order."""
    if isinstance(spec, int):
        return [out]
    kind, children = spec
    if kind == "dict":
        return [t for k, child in children for t in flatten(out[k], child)]
    return [t for o, child in zip(out, children) for t in flatten(o, child)]


def unflatten(flat: Sequence[Any], spec: Any) -> Any:
    """Rebuild the structure ``spec`` describes from its flat list of leaves."""
    if isinstance(spec, int):
        return flat[spec]
    kind, children = spec
    if kind == "dict":
        return {k: unflatten(flat, child) for k, child in children}
    items = [unflatten(flat, child) for child in children]
    return tuple(items) if kind == "tuple" else items


def leaves(spec: Any) -> int:
    """How many tensors a spec holds."""
    if isinstance(spec, int):
        return 1
    return sum(leaves(c[1] if spec[0] == "dict" else c) for c in spec[1])


def first_tensor(obj: Any) -> Optional[torch.Tensor]:
    """The first tensor met walking ``obj`` (tuples, lists, dict values), or None."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        return None
    for item in items:
        found = first_tensor(item)
        if found is not None:
            return found
    return None


def scatter(obj: Any, sizes: List[int], dim: int) -> List[Any]:
    """torch.nn.DataParallel's rule: tensors split, containers recursed, the rest shared."""
    if isinstance(obj, torch.Tensor):
        return list(obj.split_with_sizes(sizes, dim))
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):   # namedtuple
        return [type(obj)(*parts) for parts in zip(*(scatter(o, sizes, dim) for o in obj))]
    if isinstance(obj, (tuple, list)) and obj:
        return [type(obj)(parts) for parts in zip(*(scatter(o, sizes, dim) for o in obj))]
    if isinstance(obj, dict) and obj:
        keys = list(obj)
        columns = zip(*(scatter(obj[k], sizes, dim) for k in keys))
        return [type(obj)(zip(keys, col)) for col in columns]
    if isinstance(obj, (tuple, list, dict)):
        return [type(obj)() for _ in sizes]
    return [obj for _ in sizes]


def gather(outputs: List[Any], dim: int) -> Any:
    """torch.nn.DataParallel's rule: tensors concatenated (scalars stacked), containers
    element-wise, anything else taken from the first chunk."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack(outputs)
        return torch.cat(outputs, dim)
    if first is None:
        return None
    if isinstance(first, dict):
        return type(first)((k, gather([o[k] for o in outputs], dim)) for k in first)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(gather(list(group), dim) for group in zip(*outputs)))
    if isinstance(first, (tuple, list)):
        return type(first)(gather(list(group), dim) for group in zip(*outputs))
    return first


class FlatOutputs(torch.nn.Module):
    """``func`` with its outputs flattened into a tuple by ``spec``: what torch.jit.trace
    can record, whatever tree ``func`` returns."""

    def __init__(self, func: Any, spec: Any):
        super().__init__()
        self.func = func
        self.spec = spec

    def forward(self, *args):
        return tuple(flatten(self.func(*args), self.spec))
