"""The SyncBatchNorm kernels and ``linear_backward`` on the ``neuron`` device.

``nn.SyncBatchNorm`` runs on a device through five ops that PyTorch ships for CUDA
(and XPU) only, so the CPU fallback has no kernel for them; TorchNeuron has them on the
device. This module registers them for PrivateUse1, in ATen ops on the device's tensors
(so each runs the CPU's kernels, as every other op here does):

    forward   batch_norm_stats ─▶ (the process group gathers every rank's stats)
              ─▶ batch_norm_gather_stats_with_counts ─▶ batch_norm_elemt
    backward  batch_norm_backward_reduce ─▶ (the group sums two of its results)
              ─▶ batch_norm_backward_elemt

``linear_backward`` (the gradients of ``aten::linear`` in one op, as TorchNeuron's
tests call it; ATen has it only for its mkldnn and nested layouts) is the same kind
of gap. Statistics of half-precision inputs are float32, as CUDA's accumulate type.
Op tracking lists each as the one device op it is on TorchNeuron, not the ops it is
written in here.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .optrack import device_kernel

Tensor = torch.Tensor

_lib: Optional[torch.library.Library] = None


def _acc(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _channels(t: Tensor, like: Tensor) -> Tensor:
    """A per-channel vector shaped to broadcast over ``like`` (channels in dim 1)."""
    return t.reshape([1, -1] + [1] * (like.dim() - 2))


def _others(t: Tensor) -> List[int]:
    return [d for d in range(t.dim()) if d != 1]


@device_kernel("aten::batch_norm_stats")
def batch_norm_stats(input: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    """This rank's per-channel mean and inverse standard deviation (biased variance)."""
    x = _acc(input)
    var, mean = torch.var_mean(x, dim=_others(x), correction=0)
    return mean, torch.rsqrt(var + eps)


@device_kernel("aten::batch_norm_elemt")
def batch_norm_elemt(input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                     mean: Tensor, invstd: Tensor, eps: float) -> Tensor:
    """``(input - mean) * invstd * weight + bias``, per channel, in the input's dtype."""
    out = (_acc(input) - _channels(mean, input)) * _channels(invstd, input)
    if weight is not None:
        out = out * _channels(weight, input)
    if bias is not None:
        out = out + _channels(bias, input)
    return out.to(input.dtype)


@device_kernel("aten::batch_norm_gather_stats_with_counts")
def batch_norm_gather_stats_with_counts(
        input: Tensor, mean: Tensor, invstd: Tensor, running_mean: Optional[Tensor],
        running_var: Optional[Tensor], momentum: float, eps: float,
        counts: Tensor) -> Tuple[Tensor, Tensor]:
    """The whole job's mean and invstd from every rank's (rows of ``mean`` and
    ``invstd``, ``counts`` elements per channel each); updates the running statistics
    (the variance unbiased) as BatchNorm does."""
    c = counts.to(mean.dtype).reshape(-1, 1)
    n = c.sum(0)
    whole = (c * mean).sum(0) / n
    var_each = invstd.pow(-2) - eps
    var = (c * (var_each + (mean - whole).pow(2))).sum(0) / n
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(whole.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var * n / (n - 1).clamp(min=1)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype),
                                                alpha=momentum)
    return whole, torch.rsqrt(var + eps)


@device_kernel("aten::batch_norm_backward_reduce")
def batch_norm_backward_reduce(
        grad_out: Tensor, input: Tensor, mean: Tensor, invstd: Tensor,
        weight: Optional[Tensor], input_g: bool, weight_g: bool,
        bias_g: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(sum_dy, sum_dy_xmu, grad_weight, grad_bias)`` over this rank's elements, all
    four whatever the masks say, as TorchNeuron's kernel gives them (CUDA's leaves those
    not asked for undefined; SyncBatchNorm's backward drops what it did not ask for)."""
    dy, dims = _acc(grad_out), _others(grad_out)
    sum_dy = dy.sum(dims)
    sum_dy_xmu = (dy * (_acc(input) - _channels(mean, input))).sum(dims)
    dtype = weight.dtype if weight is not None else input.dtype
    return sum_dy, sum_dy_xmu, (sum_dy_xmu * invstd).to(dtype), sum_dy.to(dtype)


@device_kernel("aten::batch_norm_backward_elemt")
def batch_norm_backward_elemt(
        grad_out: Tensor, input: Tensor, mean: Tensor, invstd: Tensor,
        weight: Optional[Tensor], sum_dy: Tensor, sum_dy_xmu: Tensor,
        count: Tensor) -> Tensor:
    """The input's gradient from the whole job's sums (``count``: every rank's
    elements per channel)."""
    n = count.to(sum_dy.dtype).sum()
    mean_dy = _channels(sum_dy / n, input)
    scale = _channels(invstd, input)
    xmu = _acc(input) - _channels(mean, input)
    grad = (_acc(grad_out) - mean_dy - xmu * scale.pow(2) * _channels(sum_dy_xmu / n, input))
    grad = grad * scale
    if weight is not None:
        grad = grad * _channels(weight, input)
    return grad.to(input.dtype)


@device_kernel("aten::linear_backward")
def linear_backward(input: Tensor, grad_output: Tensor, weight: Tensor,
                    output_mask: List[bool]) -> Tuple[Tensor, Tensor, Tensor]:
    """``(grad_input, grad_weight, grad_bias)`` of ``linear(input, weight, bias)``; each
    undefined when its mask is False."""
    rows = grad_output.reshape(-1, grad_output.shape[-1])
    grad_input = grad_output.matmul(weight) if output_mask[0] else None
    grad_weight = rows.t().matmul(input.reshape(-1, input.shape[-1])) if output_mask[1] \
        else None
    grad_bias = rows.sum(0) if output_mask[2] else None
    return grad_input, grad_weight, grad_bias   # type: ignore[return-value]


def register() -> None:
    """Register the six kernels for PrivateUse1 (idempotent; the library object is
    kept, since dropping it unregisters them)."""
    global _lib
    if _lib is not None:
        return
    lib = torch.library.Library("aten", "IMPL", "PrivateUse1")
    for fn in (batch_norm_stats, batch_norm_elemt, batch_norm_gather_stats_with_counts,
               batch_norm_backward_reduce, batch_norm_backward_elemt, linear_backward):
        lib.impl(fn.__name__, fn)
    _lib = lib
