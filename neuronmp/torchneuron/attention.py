"""FlexAttention as plain tensor ops: what TorchNeuron's compile backend lowers
``torch.nn.attention.flex_attention`` to, and exports as
``torch_neuronx.neuron_dynamo_backend.decompositions.flex_attention_decomposition``.

    scores = q @ k^T * scale                 (GQA: k, v heads repeated to q's)
      score_mod(score, b, h, q_idx, kv_idx)  index tensors broadcast over scores
      block_mask.mask_mod(b, h, q_idx, kv_idx) False ─▶ -inf
    softmax over kv (a row with nothing left gives zeros and lse -inf, as flex
    attention does) ─▶ @ v;  return_lse: the rows' log-sum-exp too

Scores are computed in float32 (half-precision inputs too) and the output cast
back to the query's dtype.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Tuple, Union

import torch


def flex_attention_decomposition(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        score_mod: Optional[Callable[..., torch.Tensor]] = None,
        block_mask: Any = None, scale: Optional[float] = None, enable_gqa: bool = False,
        return_lse: bool = False, kernel_options: Optional[dict] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """``flex_attention``'s result from matmuls, a softmax and the mods, for
    (batch, heads, length, dim) query, key and value."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"flex attention takes 4-d (batch, heads, length, dim) query, key "
                         f"and value; got {query.dim()}-d, {key.dim()}-d and {value.dim()}-d")
    batch, q_heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if q_heads != kv_heads:
        if not enable_gqa or q_heads % kv_heads:
            raise ValueError(
                f"query has {q_heads} heads and key/value {kv_heads}: accepted are equal "
                "counts, or enable_gqa=True with query heads a multiple of key heads")
        key = key.repeat_interleave(q_heads // kv_heads, dim=1)
        value = value.repeat_interleave(q_heads // kv_heads, dim=1)
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    scores = torch.matmul(query.float(), key.float().transpose(-2, -1)) * scale
    if score_mod is not None or block_mask is not None:
        dev = query.device
        b = torch.arange(batch, device=dev).view(batch, 1, 1, 1)
        h = torch.arange(q_heads, device=dev).view(1, q_heads, 1, 1)
        q_idx = torch.arange(q_len, device=dev).view(1, 1, q_len, 1)
        kv_idx = torch.arange(kv_len, device=dev).view(1, 1, 1, kv_len)
        if score_mod is not None:
            scores = score_mod(scores, b, h, q_idx, kv_idx).expand_as(scores)
        if block_mask is not None:
            keep = block_mask.mask_mod(b, h, q_idx, kv_idx)
            scores = scores.masked_fill(~keep.expand_as(scores), float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    # a row masked everywhere has max -inf: shift it by 0 so it sums to 0, not NaN
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights, value.float()) / torch.where(
        total > 0, total, torch.ones_like(total))
    out = out.to(query.dtype)
    if not return_lse:
        return out
    lse = (torch.log(total) + row_max).squeeze(-1)
    return out, lse
