"""``rms_norm`` on the ``neuron`` device as TorchNeuron has it.

TorchNeuron has device kernels for ``aten::rms_norm`` (for PrivateUse1 and for
AutogradPrivateUse1, so that a DTensor's call reaches it too), ``aten::_fused_rms_norm``
and ``aten::_fused_rms_norm_backward``:

    rms_norm ─▶ _fused_rms_norm (float32 when a half-precision input meets a weight of
                another dtype) ─▶ the output cast back to the input's dtype
    backward: torch's derivative of _fused_rms_norm ─▶ _fused_rms_norm_backward

PyTorch's CPU build has no kernel for either fused op (``_fused_rms_norm`` is only a
composite there, ``_fused_rms_norm_backward`` CUDA's and MPS's), so this module gives
them to the device in ATen ops on the device's tensors, each of which runs the CPU's
kernel.  They are registered before op tracking is configured, so that tracking leaves
them (and torch's derivative of ``_fused_rms_norm``) in place and records each as the
device op it is on TorchNeuron.
"""
from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

import torch

from . import optrack

Tensor = torch.Tensor
log = logging.getLogger(__name__)

_libs: List[torch.library.Library] = []
_HALF = (torch.float16, torch.bfloat16)


def _dims(input: Tensor, normalized_shape: Sequence[int]) -> List[int]:
    return list(range(input.dim() - len(normalized_shape), input.dim()))


@optrack.device_kernel("aten::_fused_rms_norm")
def fused_rms_norm(input: Tensor, normalized_shape: Sequence[int], weight: Optional[Tensor],
                   eps: Optional[float]) -> Tuple[Tensor, Tensor]:
    """``(input * rstd * weight, rstd)``, rstd over the last ``normalized_shape`` dims
    (kept as size-1 dims) at float32 for half-precision inputs, as CUDA's kernel."""
    x = input.float() if input.dtype in _HALF else input
    if eps is None:
        eps = torch.finfo(input.dtype).eps
    rstd = torch.rsqrt(x.pow(2).mean(_dims(x, normalized_shape), keepdim=True) + eps)
    out = x * rstd
    if weight is not None:
        out = out * weight
    return out.to(input.dtype), rstd


@optrack.device_kernel("aten::_fused_rms_norm_backward")
def fused_rms_norm_backward(grad_out: Tensor, input: Tensor, normalized_shape: Sequence[int],
                            rstd: Tensor, weight: Optional[Tensor],
                            output_mask: Sequence[bool]) -> Tuple[Tensor, Tensor]:
    """``(grad_input, grad_weight)``; each undefined when its mask is False."""
    dims = _dims(input, normalized_shape)
    x = input.float() if input.dtype in _HALF else input
    g = grad_out.to(x.dtype)
    normed = x * rstd
    gw = g * weight if weight is not None else g
    grad_input = grad_weight = None
    if output_mask[0]:
        grad_input = (rstd * (gw - normed * (gw * normed).mean(dims, keepdim=True)))
        grad_input = grad_input.to(input.dtype)
    if output_mask[1] and weight is not None:
        lead = list(range(input.dim() - len(normalized_shape)))
        grad_weight = (g * normed).sum(lead).to(weight.dtype) if lead else \
            (g * normed).to(weight.dtype)
    return grad_input, grad_weight   # type: ignore[return-value]


def rms_norm(input: Tensor, normalized_shape: Sequence[int], weight: Optional[Tensor] = None,
             eps: Optional[float] = None) -> Tensor:
    """TorchNeuron's ``rms_norm`` kernel: ``_fused_rms_norm``, through the dispatcher
    (so autograd, and a DTensor's sharding, see that op), cast back."""
    optrack.record_executed("aten::rms_norm")
    dtype = input.dtype
    if weight is not None and weight.dtype != dtype and dtype in _HALF:
        input, weight = input.float(), weight.float()
    return torch.ops.aten._fused_rms_norm(input, normalized_shape, weight, eps)[0].to(dtype)


def register() -> None:
    """Register the kernels (idempotent; the library objects are kept, since dropping
    them unregisters the kernels).  Must run before op tracking is configured."""
    if _libs:
        return
    lib = torch.library.Library("aten", "IMPL", "PrivateUse1")
    lib.impl("_fused_rms_norm", fused_rms_norm)
    lib.impl("_fused_rms_norm_backward", fused_rms_norm_backward)
    lib.impl("rms_norm", rms_norm)
    autograd = torch.library.Library("aten", "IMPL", "AutogradPrivateUse1")
    autograd.impl("rms_norm", rms_norm)
    _libs.extend((lib, autograd))
    log.debug("rms_norm kernels registered for the neuron device")
