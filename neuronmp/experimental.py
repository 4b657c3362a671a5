"""``neuronmp.experimental``: the NeuronCore placement API under its pre-2.25 SDK home.

Same functions as ``neuronmp.set_neuron_cores`` etc. (see :mod:`neuronmp.placement`),
so code written for ``torch_neuronx.experimental`` runs unchanged.
"""
from __future__ import annotations

from .placement import (  # noqa: F401  (re-exported)
    multicore_context,
    neuron_cores_context,
    set_multicore,
    set_neuron_cores,
)

__all__ = ["set_neuron_cores", "set_multicore", "neuron_cores_context", "multicore_context"]
