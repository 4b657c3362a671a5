"""neuronmp's stand-ins for the Neuron SDK's Python packages (``NEURONMP_PROVIDE``).

    torch_neuronx/   imported AS ``torch_neuronx`` (and ``torch_neuronx.experimental``)
    torch_neuron/    imported AS ``torch_neuron``; registers ``torch.neuron``

The hook that maps those names here is the top-level ``_neuronmp_provide`` module
(loaded by ``_neuronmp_provide.pth`` at interpreter start, only when the variable is
set), so that a process with the variable set imports nothing of neuronmp until it
imports an alias.  The alias packages use absolute imports: they run under their SDK
names.
"""
from __future__ import annotations

import importlib.util
import os
import sys


def _hook():
    """The ``_neuronmp_provide`` module; from beside the package when the environment's
    install predates it (an editable install maps only the names it had then)."""
    try:
        import _neuronmp_provide
    except ImportError:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))), "_neuronmp_provide.py")
        spec = importlib.util.spec_from_file_location("_neuronmp_provide", path)
        if spec is None or not os.path.exists(path):
            raise
        _neuronmp_provide = importlib.util.module_from_spec(spec)
        sys.modules["_neuronmp_provide"] = _neuronmp_provide
        spec.loader.exec_module(_neuronmp_provide)
    return _neuronmp_provide


_h = _hook()
ENV, ACCEPTED, install, parse = _h.ENV, _h.ACCEPTED, _h.install, _h.parse
__all__ = ["ENV", "ACCEPTED", "install", "parse"]
