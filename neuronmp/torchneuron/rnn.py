"""The fused recurrent-cell kernels ``nn.LSTM`` / ``nn.GRU`` need on the ``neuron`` device.

For any device but the CPU, ATen's RNN code (aten/src/ATen/native/RNN.cpp) runs each
LSTM / GRU step as two matmuls plus one fused cell op, and autograd's formula for that
op calls a fused backward op; PyTorch ships those four ops for CUDA only, so the CPU
fallback has no kernel to run. This module registers them for PrivateUse1:

    nn.LSTM / nn.LSTMCell ─▶ _thnn_fused_lstm_cell          ─▶ lstm_cell (here)
      backward (no create_graph) ─▶ _thnn_fused_lstm_cell_backward_impl ─▶ lstm_cell_backward
    nn.GRU / nn.GRUCell   ─▶ _thnn_fused_gru_cell           ─▶ gru_cell
      backward (no create_graph) ─▶ _thnn_fused_gru_cell_backward ─▶ gru_cell_backward

Each kernel is the CUDA kernel's math written in ATen ops on the device's tensors (so
every step runs the CPU's kernels, as every other op here does), with the CUDA
kernel's workspace layout, which is what the backward op receives. With
``create_graph=True`` autograd uses PyTorch's composite
``_thnn_differentiable_*_backward`` instead, which needs nothing from here.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

Tensor = torch.Tensor

_lib: Optional[torch.library.Library] = None


def _gates(input_gates: Tensor, hidden_gates: Tensor, input_bias: Optional[Tensor],
           hidden_bias: Optional[Tensor]) -> Tensor:
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias
    if hidden_bias is not None:
        gates = gates + hidden_bias
    return gates


def lstm_cell(input_gates: Tensor, hidden_gates: Tensor, cx: Tensor,
              input_bias: Optional[Tensor] = None,
              hidden_bias: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """One LSTM step from its precomputed gate matmuls: ``(hy, cy, workspace)``, the
    workspace holding the activated input, forget, cell and output gates."""
    i, f, g, o = _gates(input_gates, hidden_gates, input_bias, hidden_bias).chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return hy, cy, torch.cat((i, f, g, o), 1)


def lstm_cell_backward(grad_hy: Optional[Tensor], grad_cy: Optional[Tensor], cx: Tensor,
                       cy: Tensor, workspace: Tensor,
                       has_bias: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """``(grad_gates, grad_cx, grad_bias)`` of one LSTM step; ``grad_bias`` is undefined
    without biases, all three are when neither output has a gradient (as on CUDA)."""
    if grad_hy is None and grad_cy is None:
        return None, None, None   # type: ignore[return-value]
    if grad_hy is None:
        grad_hy = torch.zeros_like(cx)
    if grad_cy is None:
        grad_cy = torch.zeros_like(cx)
    i, f, g, o = workspace.chunk(4, 1)
    tanh_cy = cy.tanh()
    grad_c = grad_hy * o * (1 - tanh_cy * tanh_cy) + grad_cy
    grad_gates = torch.cat((
        grad_c * g * (1 - i) * i,
        grad_c * cx * (1 - f) * f,
        grad_c * i * (1 - g * g),
        grad_hy * tanh_cy * (1 - o) * o,
    ), 1)
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, grad_c * f, grad_bias   # type: ignore[return-value]


def gru_cell(input_gates: Tensor, hidden_gates: Tensor, hx: Tensor,
             input_bias: Optional[Tensor] = None,
             hidden_bias: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """One GRU step from its precomputed gate matmuls: ``(hy, workspace)``, the
    workspace holding the reset, update and new gates, the hidden new-gate term
    (with its bias) and ``hx``."""
    ir, ii, in_ = (input_gates if input_bias is None else input_gates + input_bias).chunk(3, 1)
    hr, hi, hn = (hidden_gates if hidden_bias is None else hidden_gates + hidden_bias).chunk(3, 1)
    r = (ir + hr).sigmoid()
    z = (ii + hi).sigmoid()
    n = (in_ + r * hn).tanh()
    hy = n + z * (hx - n)
    return hy, torch.cat((r, z, n, hn, hx), 1)


def gru_cell_backward(grad_hy: Tensor, workspace: Tensor, has_bias: bool
                      ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias,
    grad_hidden_bias)`` of one GRU step; the bias gradients are undefined without
    biases."""
    r, z, n, hn, hx = workspace.chunk(5, 1)
    grad_n = grad_hy * (1 - z) * (1 - n * n)
    grad_r = grad_n * hn * (1 - r) * r
    grad_z = grad_hy * (hx - n) * (1 - z) * z
    grad_input = torch.cat((grad_r, grad_z, grad_n), 1)
    grad_hidden = torch.cat((grad_r, grad_z, grad_n * r), 1)
    if has_bias:
        return grad_input, grad_hidden, grad_hy * z, grad_input.sum(0), grad_hidden.sum(0)
    return grad_input, grad_hidden, grad_hy * z, None, None   # type: ignore[return-value]


def register() -> None:
    """Register the four kernels for PrivateUse1 (idempotent; the library object is
    kept, since dropping it unregisters them)."""
    global _lib
    if _lib is not None:
        return
    lib = torch.library.Library("aten", "IMPL", "PrivateUse1")
    lib.impl("_thnn_fused_lstm_cell", lstm_cell)
    lib.impl("_thnn_fused_lstm_cell_backward_impl", lstm_cell_backward)
    lib.impl("_thnn_fused_gru_cell", gru_cell)
    lib.impl("_thnn_fused_gru_cell_backward", gru_cell_backward)
    _lib = lib
