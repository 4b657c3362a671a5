"""``torch_neuronx.neuron_dynamo_backend``: TorchNeuron's compile backend package.

``neuron_backend`` is what ``torch.compile(backend="neuron")`` runs (neuronmp's, on
the cores' workers); ``decompositions.flex_attention_decomposition`` is FlexAttention
as plain tensor ops.  The compiler's passes (FX to StableHLO, NEFF caches) are not
emulated: see docs/guides/torchneuron.md.
"""
from __future__ import annotations

from neuronmp.torchneuron.backend import neuron_backend

from . import decompositions

__all__ = ["decompositions", "neuron_backend"]
