"""neuronmp's own TorchScript calls, without torch's deprecation warnings.

torch 2.13 deprecates ``torch.jit.trace``/``script``/``save``/``load`` in favour
of ``torch.export``.  ``neuronmp.trace`` must return a TorchScript module (the
Neuron SDK's contract: it is saved and loaded with ``torch.jit``), so neuronmp
uses them inside ``trace`` and in every worker that loads a model.  There,
torch's warning would ask the user to change calls the user never made, and
under ``-W error::DeprecationWarning`` (strict CI) it would make ``trace`` and
every model load fail.  A user's own ``torch.jit`` calls keep their warnings.

Imports no neuronmp module: the worker (pool layer) and ``tracing`` both use it.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

_DEPRECATED = r"`torch\.jit\.\w+` is deprecated"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Hide torch's ``torch.jit`` deprecation warnings inside the block.

    ``warnings.catch_warnings`` swaps the process-wide filter list, so for the
    moment of the block another thread's ``torch.jit`` deprecation warnings
    are hidden too; no other warning is affected.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATED, category=DeprecationWarning)
        yield
