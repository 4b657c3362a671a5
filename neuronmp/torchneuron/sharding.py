"""DTensor sharding rules for the ops the ``neuron`` device runs as one kernel where
PyTorch has none, registered at ``import torch_neuronx`` as TorchNeuron does.

``linear`` here is a device kernel whose gradient is ``aten::linear_backward``
(``syncbn.py``); DTensor knows no placement rule for that op, so a backward through a
DTensor ``linear`` stopped with "does not have a sharding strategy registered".  The
rule below gives, per mesh dimension, the placements of the three gradients for each
way the forward's operands can be laid out (``x``: input ``(..., k)``, ``w``: weight
``(n, k)``, ``g``: grad_output ``(..., n)``):

    inputs x, g, w              grad_input   grad_weight   grad_bias
    all replicated              Replicate    Replicate     Replicate
    x, g split on batch dim b   Shard(b)     Partial       Partial     (summed over b)
    g, w split on n             Partial      Shard(0)      Shard(0)    (k summed over n)
    x, w split on k             Shard(-1)    Shard(1)      Replicate

DTensor's cost model then picks the layout the operands need the fewest collectives
to reach (none when they already match one row).
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch.distributed.tensor._dtensor_spec import TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, PlacementList
from torch.distributed.tensor._ops.utils import (
    expand_to_full_mesh_op_strategy,
    register_op_strategy,
)
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

aten = torch.ops.aten

_registered = False


def _linear_backward_rows(ndim: int, mask: List[bool]) -> List[PlacementList]:
    """The table of the module's docstring, as placement lists of
    ``[grad_input, grad_weight, grad_bias, input, grad_output, weight, output_mask]``
    with the gradients the mask leaves out as None."""
    last = ndim - 1
    rows: List[PlacementList] = [[Replicate()] * 3 + [Replicate()] * 3]
    for b in range(last):
        rows.append([Shard(b), Partial(), Partial(), Shard(b), Shard(b), Replicate()])
    rows.append([Partial(), Shard(0), Shard(0), Replicate(), Shard(last), Shard(0)])
    rows.append([Shard(last), Shard(1), Replicate(), Shard(last), Replicate(), Shard(1)])
    for row in rows:
        for i in range(3):
            if not mask[i]:
                row[i] = None
        row.append(None)   # output_mask, a list of bools
    return rows


def linear_backward_strategy(op_schema: OpSchema) -> OpStrategy:
    """Placements of ``linear_backward(input, grad_output, weight, output_mask)``."""
    # the forward already checked the operands share one mesh
    mesh = op_schema.get_mesh_from_args(validate=False)
    input_s, grad_s, weight_s, mask = op_schema.args_schema
    assert isinstance(input_s, OpStrategy) and isinstance(grad_s, OpStrategy)
    assert isinstance(weight_s, OpStrategy)
    mask = [bool(m) for m in mask]
    grad_meta = grad_s.strategies[0].output_spec.tensor_meta
    bias_meta: Optional[TensorMeta] = None
    if grad_meta is not None:
        bias_meta = TensorMeta(torch.Size([grad_meta.shape[-1]]), (1,), grad_meta.dtype)
    metas = [input_s.strategies[0].output_spec.tensor_meta,
             weight_s.strategies[0].output_spec.tensor_meta, bias_meta]
    return expand_to_full_mesh_op_strategy(
        mesh, op_schema, _linear_backward_rows(len(input_s.shape), mask),
        output_tensor_meta=[m for m, on in zip(metas, mask) if on], input_index=3)


def register() -> None:
    """Register the rules with DTensor's sharding propagator (idempotent)."""
    global _registered
    if _registered:
        return
    register_op_strategy(aten.linear_backward.default)(linear_backward_strategy)
    _registered = True
