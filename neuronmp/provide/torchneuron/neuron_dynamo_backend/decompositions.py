"""``torch_neuronx.neuron_dynamo_backend.decompositions``: the decompositions a user
may call directly (FlexAttention as matmuls and a softmax)."""
from __future__ import annotations

from neuronmp.torchneuron.attention import flex_attention_decomposition

__all__ = ["flex_attention_decomposition"]
