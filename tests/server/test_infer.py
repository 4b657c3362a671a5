"""The request document as an adversary writes it, against a real neuronmp-serve (one per
module) over HTTP: wrong types in every field, deep nesting, non-finite numbers, and a
bounded fuzz of the document; every malformed request is a 4xx KServe error
(``{"error": ...}``) and the server keeps serving.
"""
from __future__ import annotations

import http.client
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("tritonclient.http")


def _strict(text: str):
    """JSON as the standard has it: no NaN or Infinity tokens."""
    def refuse(token):
        raise AssertionError(f"not JSON: {token}")
    return json.loads(text, parse_constant=refuse)


def _post(server, path: str, body: bytes, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", path, body=body,
                     headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read().decode("utf-8", "replace"), r.getheader("Content-Type")
    finally:
        conn.close()


def _infer(server, doc, model="mlp"):
    body = doc if isinstance(doc, (bytes, str)) else json.dumps(doc)
    body = body.encode() if isinstance(body, str) else body
    return _post(server, f"/v2/models/{model}/infer", body)


def _error(status: int, text: str, ctype: str) -> str:
    assert 400 <= status < 500, (status, text)
    assert ctype.split(";")[0] == "application/json", (ctype, text)
    doc = _strict(text)
    assert isinstance(doc, dict) and isinstance(doc.get("error"), str), text
    return doc["error"]


def _mlp_doc(**over):
    inp = {"name": "INPUT__0", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}
    inp.update(over.pop("input", {}))
    doc = {"inputs": [inp]}
    doc.update(over)
    return doc


def _alive(server) -> None:
    status, text, _ = _infer(server, _mlp_doc())
    assert status == 200, text
    assert len(_strict(text)["outputs"][0]["data"]) == 3


@pytest.mark.parametrize("doc, field", [
    (_mlp_doc(input={"parameters": "binary"}), "inputs[0].parameters"),
    (_mlp_doc(input={"parameters": [1]}), "inputs[0].parameters"),
    (_mlp_doc(input={"parameters": 5}), "inputs[0].parameters"),
    (_mlp_doc(outputs=5), "outputs"),
    (_mlp_doc(outputs={"OUTPUT__0": {}}), "outputs"),
    (_mlp_doc(outputs=[{"name": "OUTPUT__0", "parameters": "x"}]), "outputs[0].parameters"),
    (_mlp_doc(outputs=[{"name": ["OUTPUT__0"]}]), "outputs[0].name"),
    (_mlp_doc(outputs=[{"name": "OUTPUT__0", "parameters": {"binary_data": "no"}}]),
     "outputs[0].parameters.binary_data"),
    (_mlp_doc(outputs=[{"name": "OUTPUT__0",
                        "parameters": {"shared_memory_region": ["r"]}}]),
     "outputs[0].parameters.shared_memory_region"),
    (_mlp_doc(input={"parameters": {"shared_memory_region": ["r"],
                                    "shared_memory_byte_size": 64}}),
     "inputs[0].parameters.shared_memory_region"),
    (_mlp_doc(input={"parameters": {"shared_memory_region": "r",
                                    "shared_memory_byte_size": 64,
                                    "shared_memory_offset": True}}),
     "inputs[0].parameters.shared_memory_offset"),
    (_mlp_doc(parameters={"binary_data_output": "no"}), "parameters.binary_data_output"),
    (_mlp_doc(parameters={"binary_data_output": 0}), "parameters.binary_data_output"),
    (_mlp_doc(input={"shape": [True, 16]}), "inputs[0].shape"),
    (_mlp_doc(input={"shape": [1.0, 16]}), "inputs[0].shape"),
    (_mlp_doc(input={"datatype": ["FP32"]}), "inputs[0].datatype"),
    (_mlp_doc(id=5), "id"),
    (_mlp_doc(id={"a": 1}), "id"),
    (_mlp_doc(parameters=[1]), "parameters"),
    ({"inputs": {"INPUT__0": {}}}, "inputs"),
    ([1, 2], "the request"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_field_of_the_wrong_type_is_400_naming_it(server, doc, field):
    msg = _error(*_infer(server, doc))
    assert field in msg, msg


def test_deeply_nested_json_is_a_kserve_400_not_a_500(server):
    deep = "[" * 100_000 + "]" * 100_000
    for body in (deep, '{"inputs": ' + deep + "}",
                 json.dumps(_mlp_doc())[:-1] + ', "parameters": {"x": ' + deep + "}}"):
        msg = _error(*_infer(server, body))
        assert "nested" in msg, msg
    status, text, ctype = _post(server, "/v2/systemsharedmemory/region/r/register",
                                ('{"key": ' + deep + "}").encode())
    assert "nested" in _error(status, text, ctype)
    _alive(server)


def test_non_finite_values_travel_as_strings_and_the_response_is_json(server):
    # the "slow" model is the identity on [1, 4] FP32: what goes in comes out
    given = ["NaN", "Infinity", "-Infinity", 1.5]
    doc = {"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4],
                       "data": given}]}
    status, text, _ = _infer(server, doc, model="slow")
    assert status == 200, text
    assert _strict(text)["outputs"][0]["data"] == given
    # the tokens some JSON writers emit for them are read as the same values
    body = '{"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], ' \
           '"data": [NaN, Infinity, -Infinity, 1.5]}]}'
    status, text, _ = _infer(server, body, model="slow")
    assert status == 200, text
    assert _strict(text)["outputs"][0]["data"] == given


@pytest.mark.parametrize("number", ["1e400", "-1e400", "1e39"])
def test_a_number_out_of_the_datatypes_range_is_400_not_infinity(server, number):
    body = '{"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 16], ' \
           f'"data": [{number}' + ", 0" * 15 + "]}]}"
    msg = _error(*_infer(server, body))
    assert "INPUT__0" in msg and "range" in msg, msg


def test_an_unknown_non_finite_string_is_400(server):
    msg = _error(*_infer(server, _mlp_doc(input={"data": ["nan"] + [0.0] * 15})))
    assert "INPUT__0" in msg and "'NaN', 'Infinity' or '-Infinity'" in msg, msg


# -- fuzz ---------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) |
    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=8)
# where a mutation lands: a path into the valid request for "mlp"
_PATHS = [(), ("inputs",), ("inputs", 0), ("inputs", 0, "name"), ("inputs", 0, "datatype"),
          ("inputs", 0, "shape"), ("inputs", 0, "shape", 0), ("inputs", 0, "data"),
          ("inputs", 0, "data", 3), ("inputs", 0, "parameters"),
          ("inputs", 0, "parameters", "binary_data_size"),
          ("inputs", 0, "parameters", "shared_memory_region"),
          ("inputs", 0, "parameters", "shared_memory_byte_size"),
          ("inputs", 0, "parameters", "shared_memory_offset"),
          ("outputs",), ("outputs", 0), ("outputs", 0, "name"), ("outputs", 0, "parameters"),
          ("outputs", 0, "parameters", "binary_data"),
          ("outputs", 0, "parameters", "shared_memory_region"),
          ("outputs", 0, "parameters", "shared_memory_byte_size"),
          ("parameters",), ("parameters", "binary_data_output"), ("parameters", "priority"),
          ("parameters", "timeout"), ("id",)]


def _valid():
    doc = _mlp_doc(outputs=[{"name": "OUTPUT__0", "parameters": {"binary_data": False}}],
                   parameters={"binary_data_output": False}, id="x")
    doc["inputs"][0]["parameters"] = {}
    return doc


def _mutated(path, value):
    doc = _valid()
    if not path:
        return value
    at = doc
    for key in path[:-1]:
        at = at[key]
    if isinstance(at, list):
        at[path[-1]] = value
    else:
        at[path[-1]] = value
    return doc


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(path=st.sampled_from(_PATHS), value=_json)
def test_fuzzed_request_documents_get_a_kserve_4xx_or_an_answer(server, path, value):
    doc = _mutated(path, value)
    status, text, ctype = _infer(server, doc)
    if status == 200:
        out = _strict(text)["outputs"]
        assert all(math.isfinite(v) for o in out for v in o["data"]), text
    else:
        _error(status, text, ctype)
    assert server.proc.poll() is None, server.proc.communicate()


def test_the_server_serves_after_the_fuzz(server):
    _alive(server)


def test_grpc_typed_contents_carry_non_finite_values_as_they_are(server):
    # gRPC has float fields: NaN and the infinities arrive as values, not as names,
    # and must not be taken for a number out of range
    grpc = pytest.importorskip("grpc")
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    from tritonclient.grpc import service_pb2_grpc

    request = service_pb2.ModelInferRequest(model_name="slow")
    inp = request.inputs.add(name="INPUT__0", datatype="FP32", shape=[1, 4])
    inp.contents.fp32_contents.extend([math.nan, math.inf, -math.inf, 1.5])
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        response = stub.ModelInfer(request, timeout=60)
    got = np.frombuffer(response.raw_output_contents[0], dtype=np.float32)
    np.testing.assert_array_equal(got, np.array([np.nan, np.inf, -np.inf, 1.5], np.float32))
