"""The ``neuronmp::forward`` and ``neuronmp::register`` TorchScript ops.

A traced model (see :mod:`neuronmp.tracing`) is a scripted wrapper whose forward is one
call of ``neuronmp::forward(handle, inputs)``; its TorchScript ``__setstate__`` calls
``neuronmp::register``, so every ``torch.jit.load`` registers a fresh
:class:`~neuronmp.session.model.Model` placed by the active placement context (or the
least-used default) and loads it onto its cores, as the SDK does.

    model(x) ── TorchScript ── neuronmp::forward(handle, [x]) ── Python kernel
                                    └─▶ model.get(handle).run([x])  (the one request path)

Called from Python, the object ``neuronmp.trace`` returns skips this op (see
tracing.py): the kernel is for loaded modules and scripted callers.
``import neuronmp`` registers these ops as soon as torch is imported, so a saved
traced model loads in a fresh process after ``import neuronmp``.
"""
from __future__ import annotations

from typing import List

import torch

from .session import model as _model

_lib = torch.library.Library("neuronmp", "DEF")
_lib.define("forward(int handle, Tensor[] inputs) -> Tensor[]")
_lib.define("register(Tensor graph, str meta, bool dynamic) -> int")


def _forward_kernel(handle: int, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
    return _model.get(handle).run(inputs)


def _register_kernel(graph: torch.Tensor, meta: str, dynamic: bool) -> int:
    return _model.attach(graph, meta, dynamic)


# CompositeExplicitAutograd: one Python kernel for every backend key, autograd included
# (traced models are inference-only, like the SDK's)
_lib.impl("forward", _forward_kernel, "CompositeExplicitAutograd")
_lib.impl("register", _register_kernel, "CompositeExplicitAutograd")
