"""The old home of the BatchingServer, kept for one release; and ``python -m neuronmp.serve``.

    from neuronmp.serve import BatchingServer   # works, with a DeprecationWarning
    from neuronmp.batching import BatchingServer  # the new path
    python -m neuronmp.serve ...                 # neuronmp-serve, no warning

The BatchingServer lives in :mod:`neuronmp.batching`; the protocol front end in
:mod:`neuronmp.server`.  This package imports neither until asked: a module that
ran the command and also held the server's code imported itself twice through
the server (serve -> server.__main__ -> server.models -> serve).
"""
from __future__ import annotations

import importlib
import warnings

_MOVED = ("BatchingServer", "QueuePolicy", "QueueFullError", "RequestTimeoutError",
          "ServerClosedError")

__all__ = list(_MOVED)


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module 'neuronmp.serve' has no attribute {name!r}")
    warnings.warn(f"neuronmp.serve.{name} moved to neuronmp.batching.{name}; the old path "
                  "goes in the next release", DeprecationWarning, stacklevel=2)
    value = getattr(importlib.import_module("neuronmp.batching"), name)
    globals()[name] = value   # once per name: `from x import y` looks a name up twice
    return value


def __dir__():
    return sorted(set(globals()) | set(_MOVED))
