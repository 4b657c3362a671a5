"""The KServe v2 request document's form, checked before anything reads it, and the JSON
form of tensor data both ways (non-finite values included).

    HTTP body ─▶ loads (JSON; too deep: 400; NaN/Infinity tokens kept as their names)
    gRPC message ─▶ (grpc_service._as_v2) ─┐
                                            ├─▶ check: every field's type, named
                                            │   (inputs[0].parameters.shared_memory_offset)
                                            └─▶ shm_peer: regions only for local peers
    "data" ─▶ tensor_from_json (numbers; "NaN", "Infinity", "-Infinity"; a number out
              of the datatype's range refused)        tensor ─▶ json_values (same names)

JSON has no NaN or infinity: the JSON form carries them as the strings "NaN",
"Infinity" and "-Infinity", in requests and responses alike (the bare tokens some
writers emit are read as the same values; responses are always strict JSON).  A
number too large for the datatype (``1e400``, or ``1e39`` for FP32) is an error,
never silently an infinity.  Messages name the field and what is accepted (400).
"""
from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .errors import InferRequestError
from .shm import check_peer

#: The JSON form's names of the non-finite values.
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_INT_PARAMS = ("binary_data_size", "shared_memory_byte_size", "shared_memory_offset")


def loads(body: bytes, what: str = "the request") -> Any:
    """The document in ``body``; InferRequestError when it is not JSON or is nested too
    deeply to read (Python's parser recurses)."""
    try:
        return json.loads(body, parse_constant=str)   # NaN, Infinity: kept as names
    except RecursionError:
        raise InferRequestError(None, f"{what} is JSON nested too deeply to read") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, a 5000-digit number
        raise InferRequestError(None, f"{what} is not JSON: {exc}") from None


def check(req: Any) -> None:
    """Refuse a request document whose fields have the wrong types, naming the field."""
    if not isinstance(req, dict):
        raise InferRequestError(None, "the request is not a JSON object")
    if "id" in req and not isinstance(req["id"], str):
        _refuse("id", req["id"], "a string")
    params = _params(req.get("parameters"), "parameters")
    _bool(params, "binary_data_output", "parameters")
    inputs = req.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        _refuse("inputs", inputs, "a non-empty list of tensors (the request has no 'inputs' "
                "list)")
    for i, t in enumerate(inputs):
        _tensor(t, f"inputs[{i}]")
    outputs = req.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            _refuse("outputs", outputs, "a list of {name, parameters} objects")
        for i, o in enumerate(outputs):
            _output(o, f"outputs[{i}]")


def shm_peer(req: dict, peer: Optional[str]) -> None:
    """Refuse a request naming a shared-memory region from a peer not on this host."""
    for key in ("inputs", "outputs"):
        tensors = req.get(key)
        for t in tensors if isinstance(tensors, list) else ():
            params = t.get("parameters") if isinstance(t, dict) else None
            if isinstance(params, dict) and "shared_memory_region" in params:
                check_peer(str(params["shared_memory_region"]), peer)


def tensor_from_json(name: str, data: Any, dtype: torch.dtype, shape: Sequence[int],
                     numel: int) -> torch.Tensor:
    """Input ``name``'s JSON ``data`` as a tensor of ``dtype`` and ``shape``."""
    named = 0
    try:
        t = torch.tensor(data, dtype=dtype)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        if not dtype.is_floating_point:
            raise InferRequestError(name, f"data cannot be read as {dtype}: {exc}") from None
        data, named = _named_floats(name, data)
        try:
            t = torch.tensor(data, dtype=dtype)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc2:
            raise InferRequestError(name, f"data cannot be read as {dtype}: {exc2}") from None
    if dtype.is_floating_point and int((~torch.isfinite(t)).sum()) > named:
        raise InferRequestError(name, f"data has a number out of the range of {dtype} "
                                f"(largest finite {torch.finfo(dtype).max:g}); infinity is "
                                "written 'Infinity' or '-Infinity'")
    if t.numel() != numel:
        raise InferRequestError(name, f"data has {t.numel()} elements; shape {list(shape)} "
                                f"needs {numel}")
    return t.reshape(shape)


def json_values(t: torch.Tensor) -> List[Any]:
    """A tensor's values for the JSON form, flat; non-finite ones by name."""
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    values = t.flatten().tolist()
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        values = named(values)
    return values


def named(values: List[float]) -> List[Any]:
    """``values`` with NaN and the infinities replaced by their JSON-form names."""
    if all(map(math.isfinite, values)):
        return values
    return [v if math.isfinite(v) else
            ("NaN" if v != v else "Infinity" if v > 0 else "-Infinity") for v in values]


# -- helpers ----------------------------------------------------------------------------


def _refuse(field: str, value: Any, accepted: str) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise InferRequestError(None, f"{field} {shown} is not valid: {accepted}")


def _params(value: Any, where: str) -> Dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        _refuse(where, value, "an object of parameters")
    return value


def _bool(params: Dict[str, Any], key: str, where: str) -> None:
    if key in params and not isinstance(params[key], bool):
        _refuse(f"{where}.{key}", params[key], "true or false")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _region_params(params: Dict[str, Any], where: str) -> None:
    region = params.get("shared_memory_region")
    if "shared_memory_region" in params and (not isinstance(region, str) or not region):
        _refuse(f"{where}.shared_memory_region", region, "a registered region's name")
    for key in _INT_PARAMS:
        if key in params and not _whole(params[key]):
            _refuse(f"{where}.{key}", params[key], "a whole number >= 0")


def _tensor(t: Any, where: str) -> None:
    if not isinstance(t, dict):
        _refuse(where, t, "an object with name, datatype, shape and data or parameters")
    for key in ("name", "datatype"):
        if not isinstance(t.get(key), str):
            _refuse(f"{where}.{key}", t.get(key), "a string")
    shape = t.get("shape")
    if not isinstance(shape, list) or not all(_whole(d) for d in shape):
        _refuse(f"{where}.shape", shape, "a list of whole numbers >= 0")
    params = _params(t.get("parameters"), f"{where}.parameters")
    _region_params(params, f"{where}.parameters")


def _output(o: Any, where: str) -> None:
    if not isinstance(o, dict):
        _refuse(where, o, "an object {name, parameters}")
    if not isinstance(o.get("name"), str):
        _refuse(f"{where}.name", o.get("name"), "a string, one of the model's outputs")
    params = _params(o.get("parameters"), f"{where}.parameters")
    _bool(params, "binary_data", f"{where}.parameters")
    _region_params(params, f"{where}.parameters")


def _named_floats(name: str, data: Any) -> Tuple[Any, int]:
    """``data`` with the JSON form's names of non-finite values replaced by them, and
    how many there were; any other string is refused."""
    count = 0

    def walk(v: Any) -> Any:
        nonlocal count
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, str):
            if v not in NON_FINITE:
                raise InferRequestError(name, f"data holds the string {v[:20]!r}: numbers "
                                        "are accepted, and 'NaN', 'Infinity' or '-Infinity' "
                                        "for the values JSON has no number for")
            count += 1
            return NON_FINITE[v]
        return v

    try:
        return walk(data), count
    except RecursionError:
        raise InferRequestError(name, "data is nested too deeply") from None
