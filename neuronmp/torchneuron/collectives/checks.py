"""The arguments TorchNeuron's process group refuses, refused here as it refuses them.

    group.py   ProcessGroupNeuron.<collective> ─▶ a check below ─▶ None, or the error
               it raises after announcing the refusal to its peers (group._refuse)

Each check returns the error TorchNeuron raises (its class, and its message as the
phrase a caller matches) or None.  TorchNeuron raises ``ValueError`` for what its
backend checks before it runs a collective (a tensor off the device, a root outside
the group, all_gather's empty tensors) -- CollectiveUsageError here -- and
``RuntimeError`` for what its collective ops cannot handle (all_reduce's empty
tensors, an all_gather_into_tensor output of the wrong shape) -- CollectiveOpError.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from ...errors import CollectiveOpError, CollectiveUsageError


def _flat(tensors) -> Iterable[torch.Tensor]:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            yield t
        elif t is not None:
            yield from _flat(t)


def devices(name: str, *tensors) -> Optional[Exception]:
    """Every tensor must live on the neuron device (TorchNeuron finds no stream for
    another device's tensor)."""
    for t in _flat(tensors):
        if t.device.type != "neuron":
            return CollectiveUsageError(name, f"Expected neuron device, got {t.device.type}")
    return None


def root(name: str, rank: int, size: int) -> Optional[Exception]:
    """The root of reduce, broadcast and gather must be a rank of the group (TorchNeuron's
    message names broadcast whichever collective it checks)."""
    if rank < 0 or rank >= size:
        return CollectiveUsageError(name, f"Invalid rootRank {rank} for broadcast with "
                                          f"world size {size}")
    return None


def not_empty(name: str, tensors: Sequence[torch.Tensor]) -> Optional[Exception]:
    """A reduction of an empty tensor is refused (its op has nothing to reduce)."""
    empty = [i for i, t in enumerate(tensors) if t.numel() == 0]
    if empty:
        return CollectiveOpError(name, f"tensors cannot be empty, found empty tensors at "
                                       f"indices: {empty}")
    return None


def dim0(name: str, *tensors, op: bool = False) -> Optional[Exception]:
    """The gathers refuse any tensor with no rows: all_gather in TorchNeuron's backend
    (ValueError), the others (``op``) in its all_gather op (RuntimeError)."""
    flat = list(_flat(tensors))
    empty = [(i, t.shape) for i, t in enumerate(flat) if t.dim() and t.size(0) == 0]
    if empty:
        found = ", ".join(f"tensor[{i}]: {shape}" for i, shape in empty)
        return (CollectiveOpError if op else CollectiveUsageError)(
            name, f"tensors cannot have zero size in dimension 0, found: {found}")
    return None


def exchanged(name: str, inputs: Sequence[torch.Tensor], size: int) -> Optional[Exception]:
    """all_to_all's inputs: one per rank of the group, all of one shape."""
    if len(inputs) != size:
        return CollectiveOpError(name, f"number of input tensors ({len(inputs)}) must equal "
                                       f"world size ({size})")
    first = inputs[0].shape
    odd = [(i, t.shape) for i, t in enumerate(inputs) if t.shape != first]
    if odd:
        found = ", ".join(f"tensor[{i}]: {shape}" for i, shape in odd)
        return CollectiveOpError(name, f"all input tensors must have same shape, expected "
                                       f"{first} but found: {found}")
    return None


def gathered_shape(name: str, output: torch.Tensor, input: torch.Tensor,
                   size: int) -> Optional[Exception]:
    """all_gather_into_tensor's output holds the group's inputs joined along dim 0 (of
    tensors of different ranks TorchNeuron names their squeezed shapes)."""
    if output.numel() == input.numel() * size:
        return None   # any shape of the right size: the gathered rows are contiguous
    if output.dim() != input.dim():
        output, input = output.squeeze(), input.squeeze()
    want = (size * input.shape[0], *input.shape[1:]) if input.dim() else (size,)
    return CollectiveOpError(name, f"output shape mismatch, expected {want}, got "
                                   f"{output.shape}")


def scattered(name: str, whole: torch.Tensor, part: torch.Tensor,
              size: int) -> Tuple[List[int], int, Optional[Exception]]:
    """reduce_scatter's one-tensor form: ``whole`` holds the group's ``size`` parts
    shaped like ``part`` along one dim.  Of tensors of different ranks the shorter
    shape gains leading 1s, as in TorchNeuron.  (whole's shape so padded, the dim, or
    the error TorchNeuron's op raises.)"""
    if whole.numel() == 0 or part.numel() == 0:
        return [], 0, CollectiveOpError(name, "tensors cannot be empty, found empty tensors "
                                              "at indices: [0]")
    a, b = list(whole.shape), list(part.shape)
    a, b = [1] * (len(b) - len(a)) + a, [1] * (len(a) - len(b)) + b
    differ = [d for d in range(len(a)) if a[d] != b[d]]
    if len(differ) > 1:
        found = ", ".join(f"dim[{d}]: {a[d]} -> {b[d]}" for d in differ)
        return a, 0, CollectiveOpError(name, f"single tensor scatter can only differ in one "
                                             f"dimension, found differences in: {found}")
    if not differ:
        return a, 0, CollectiveOpError(name, f"when input and output shapes are identical, "
                                             f"replica group must have size 1, got {size}")
    d = differ[0]
    if a[d] != b[d] * size:
        return a, d, CollectiveOpError(
            name, f"scatter dimension {d}: input size ({a[d]}) must be evenly divisible by "
                  f"replica group size ({size}), but {a[d]} / {size} = {a[d] / size}. "
                  f"Expected output size: {a[d] // size}, actual output size: {b[d]}")
    return a, d, None


#: the reduce ops TorchNeuron's reduce_scatter lowers (PREMUL_SUM reaches it as SUM of
#: scaled inputs)
_SCATTER_OPS = ("SUM", "AVG", "MIN", "MAX")


def scatter_op(name: str, kind) -> Optional[Exception]:
    """reduce_scatter of an op (a ReduceOp's RedOpType) TorchNeuron's reduce_scatter
    cannot lower (PRODUCT and the bitwise ops): refused with its op's words."""
    kind_name = kind.name
    if kind_name in _SCATTER_OPS or kind_name == "PREMUL_SUM":
        return None
    return CollectiveOpError(name, f"unsupported reduce operation '{kind_name}', "
                                   f"supported ops: {list(_SCATTER_OPS)}")


def scatter_call(name: str, kind, *tensors) -> Optional[Exception]:
    """A reduce_scatter's tensors off the device, then an op it cannot lower."""
    return devices(name, *tensors) or scatter_op(name, kind)


def scatter_sizes(name: str, whole: torch.Tensor, part: torch.Tensor,
                  size: int) -> Optional[Exception]:
    """reduce_scatter_tensor's input that does not hold ``size`` outputs: TorchNeuron's
    words for the dim where they differ (None when the sizes fit, or when the shapes
    name no such dim: the caller's own size check speaks then)."""
    if whole.numel() == part.numel() * size:
        return None
    return scattered(name, whole, part, size)[2]


def rows_alike(name: str, inputs: Sequence[torch.Tensor]) -> Optional[Exception]:
    """reduce_scatter_tensor_coalesced's non-empty inputs scatter as one: alike in every
    dim but the first."""
    if any(t.shape[1:] != inputs[0].shape[1:] for t in inputs):
        return CollectiveUsageError(name, "reduce_scatter_tensor_coalesced requires all input "
                                          "tensors to have the same shape except dimension "
                                          f"0. Got shapes: {[t.shape for t in inputs]}")
    return None


def split_sizes(splits: Optional[Sequence[int]], which: str, t: torch.Tensor, size: int
                ) -> Optional[Exception]:
    """all_to_all_single's split sizes of ``t`` as TorchNeuron takes them: none
    (equal parts) or one row per rank, else NotImplementedError in its words (equal
    parts of more rows are refused too: its XLA all-to-all takes no other).  Ones
    must add up to ``t``'s dim 0, as torch.split has them, and be one per rank, as
    its all_to_all has them."""
    if not splits:
        return None
    rows = t.shape[0] if t.dim() else 1
    if all(n == 1 for n in splits):
        if len(splits) != rows:
            return CollectiveOpError("all_to_all_single", (
                f"split_with_sizes expects split_sizes to sum exactly to {rows} (input "
                f"tensor's size at dimension 0), but got split_sizes={list(splits)}"))
        return None if rows == size else CollectiveOpError("all_to_all_single", (
            f"number of input tensors ({rows}) must equal world size ({size})"))
    if len(splits) != size:
        return NotImplementedError(f"alltoall_base: {which}_split_sizes length "
                                   f"({len(splits)}) must match group_size ({size})")
    return NotImplementedError(f"alltoall_base: Only even split sizes are supported. "
                               f"Got {which}_split_sizes: {list(splits)}")


def exchange_groups(name: str, ranks: Sequence[int], world: int) -> Optional[Exception]:
    """all_to_all over a sub-group of the world: TorchNeuron lays the world out as
    replica groups (this group's ranks first, then the others in order, as many alike)
    that its hardware exchanges only in meshes of 4, 8, 16 or a multiple of 32 ranks,
    each starting at a multiple of its size.  (The world's own group is not checked
    here.)"""
    size = len(ranks)
    if size == world:
        return None
    if world % size:
        return CollectiveUsageError(name, f"Cannot create global_replica_group when "
                                          f"world_size:{world} is not divisible by "
                                          f"group_size: {size}.")
    if size not in (4, 8, 16) and size % 32:
        return CollectiveOpError(name, f"unsupported world size {size}, supported sizes: "
                                       f"4, 8, 16, or multiples of 32")
    rest = [r for r in range(world) if r not in ranks]
    groups = [list(ranks)] + [rest[i:i + size] for i in range(0, world - size, size)]
    bad = [f"group[{i}] {g} starts at rank {g[0]}" for i, g in enumerate(groups)
           if g[0] % size]
    if bad:
        return CollectiveOpError(name, f"replica group start ranks must be multiples of "
                                       f"world size ({size}), found: {', '.join(bad)}")
    return None


def gathered_lists(name: str, output_lists: Sequence[Sequence[torch.Tensor]],
                   inputs: Sequence[torch.Tensor], size: int) -> Optional[Exception]:
    """all_gather_coalesced: every output tensor shaped as its input (TorchNeuron's op
    sees the outputs as one flat list, input by input)."""
    outs = [o for lst in output_lists for o in lst]
    if len(inputs) == 1:
        odd = [(i, o.shape) for i, o in enumerate(outs) if o.shape != inputs[0].shape]
        if odd:
            found = ", ".join(f"output[{i}]: {shape}" for i, shape in odd)
            return CollectiveOpError(name, f"with slice_output=True, all output tensors "
                                           f"must match input shape {inputs[0].shape}, "
                                           f"found: {found}")
        return None
    if len(outs) != len(inputs) * size:
        return CollectiveOpError(name, f"with slice_output=True and {len(inputs)} input "
                                       f"tensors, expected {len(inputs) * size} output "
                                       f"tensors, got {len(outs)}")
    for i, inp in enumerate(inputs):
        for j in range(size):
            o = outs[i * size + j]
            if o.shape != inp.shape:
                return CollectiveOpError(name, f"output tensor at index {i * size + j} has "
                                               f"shape {o.shape}, expected {inp.shape} to "
                                               f"match input tensor {i}")
    return None
