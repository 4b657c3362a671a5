"""The errors of neuronmp-serve: a model repository it cannot serve, a request it cannot
run, a shared-memory region it refuses.

Like every neuronmp error they carry their facts as fields and pickle with them
(``NeuronmpError.__reduce__``); the root ``neuronmp`` namespace names them too.
"""
from __future__ import annotations

from typing import Any, Optional

from ..errors import NeuronmpError


class ModelConfigError(NeuronmpError, ValueError):
    """A model repository entry (its config.pbtxt / config.json, or its files) that
    neuronmp-serve cannot serve; raised at start, before any request is taken."""

    _fields = ("path", "field", "value", "accepted")

    def __init__(self, path: str, field: str, value: Any, accepted: str):
        self.path = path
        self.field = field
        self.value = value
        self.accepted = accepted
        super().__init__(f"{path}: {field} = {value!r} is not valid. Accepted: {accepted}")


class InferRequestError(NeuronmpError, ValueError):
    """An inference request over the protocol that cannot be run as sent (HTTP 400):
    a tensor's name, shape, datatype, data or shared-memory reference is wrong."""

    _fields = ("tensor", "message")

    def __init__(self, tensor: Optional[str], message: str):
        self.tensor = tensor
        self.message = message
        super().__init__(f"input '{tensor}': {message}" if tensor else message)


class SharedMemoryError(NeuronmpError, ValueError):
    """A system shared-memory region neuronmp-serve refuses to register or use."""

    _fields = ("region", "message")

    def __init__(self, region: str, message: str):
        self.region = region
        self.message = message
        super().__init__(f"shared memory region '{region}': {message}")
