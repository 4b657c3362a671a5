"""neuronmp-serve's HTTP front end with binary tensors: outputs of every datatype come
back exactly (BF16 included), large outputs too, from a real server and a raw client.

The input side's zero-copy (tensors on the request body's bytes) is checked in
process, on the served model's decode: the tensor handed to the model shares the
body's memory, and the body is never written.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import numpy as np
import psutil
import pytest
import torch

import neuronmp
from neuronmp.launch.launcher import free_port
from neuronmp.server.config import load_model
from neuronmp.server.models import TORCH_DTYPES, ServedModel
from neuronmp.server.shm import Registry

pytest.importorskip("aiohttp")

KINDS = ["FP32", "INT64", "BOOL", "BF16", "FP16", "UINT8", "INT8", "FP64"]
BIG = (1, 300_000)    # a 1.2 MB output: past the one-buffer size, written piece by piece


class Kinds(torch.nn.Module):
    def forward(self, f32, i64, b, bf16, f16, u8, i8, f64):
        return f32 * 2, i64 + 1, b.logical_not(), bf16 * 2, f16 + 1, u8 + 1, i8 - 1, f64 / 3


def _examples(rows):
    g = torch.Generator().manual_seed(rows)
    return (torch.rand(rows, 3, generator=g), torch.randint(-9, 9, (rows, 3), generator=g),
            torch.rand(rows, 3, generator=g) > 0.5,
            torch.rand(rows, 3, generator=g).to(torch.bfloat16),
            torch.rand(rows, 3, generator=g).half(),
            torch.randint(0, 200, (rows, 3), generator=g).to(torch.uint8),
            torch.randint(-100, 100, (rows, 3), generator=g).to(torch.int8),
            torch.rand(rows, 3, generator=g, dtype=torch.float64))


_REPO = """
import os, sys, torch, neuronmp
sys.path.insert(0, {here!r})
from test_app import Kinds, _examples, BIG
root = {root!r}
os.makedirs(f"{{root}}/kinds/1"); os.makedirs(f"{{root}}/big/1")
torch.jit.save(neuronmp.trace(Kinds(), _examples(2)), f"{{root}}/kinds/1/model.pt")
torch.jit.save(neuronmp.trace(lambda x: x * 2, torch.rand(*BIG)), f"{{root}}/big/1/model.pt")
neuronmp.shutdown()
"""


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("repository"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_RT_")}
    # traced in a runtime directory of its own, not the host's default (other processes')
    build = tempfile.mkdtemp(prefix="nmp-app-build-", dir="/dev/shm")
    try:
        subprocess.run([sys.executable, "-c", _REPO.format(
            here=os.path.dirname(__file__), root=root)], check=True, timeout=120,
            env={**env, "NEURONMP_RUNTIME_DIR": build, "NEURONMP_TOPOLOGY": "1x2"})
    finally:
        shutil.rmtree(build, ignore_errors=True)
    rundir = tempfile.mkdtemp(prefix="nmp-app-test-", dir="/dev/shm")
    port = free_port()
    # marked shared: it serves the whole module, the per-test leak check passes it by
    env.update(NEURONMP_RUNTIME_DIR=rundir, NEURONMP_TOPOLOGY="1x2",
               NEURONMP_TEST_SHARED_SERVER="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "neuronmp.serve", "--model-repository", root, "--http-port",
         str(port), "--metrics-port", "0", "--grpc-port", "0", "--host", "127.0.0.1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        _wait_ready(proc, f"http://127.0.0.1:{port}")
        yield f"http://127.0.0.1:{port}"
    finally:
        tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)] \
            if proc.poll() is None else []
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
            psutil.wait_procs([psutil.Process(p) for p in tree if psutil.pid_exists(p)],
                              timeout=5)
            shutil.rmtree(rundir, ignore_errors=True)


def _wait_ready(proc, url):
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None:
            raise AssertionError(f"neuronmp-serve exited: {proc.communicate()}")
        assert time.monotonic() < deadline, "neuronmp-serve not ready within 90 s"
        time.sleep(0.1)


def _binary_infer(url, model, names, tensors):
    """One binary request (every input and output as raw bytes); the outputs by name."""
    header = json.dumps({
        "inputs": [{"name": n, "datatype": _v2(t), "shape": list(t.shape),
                    "parameters": {"binary_data_size": t.numel() * t.element_size()}}
                   for n, t in zip(names, tensors)],
        "parameters": {"binary_data_output": True}}).encode()
    body = header + b"".join(t.contiguous().view(torch.uint8).numpy().tobytes()
                             for t in tensors)
    req = urllib.request.Request(f"{url}/v2/models/{model}/infer", data=body, headers={
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(req, timeout=60) as r:
        n = int(r.headers["Inference-Header-Content-Length"])
        raw = r.read()
    doc, at, out = json.loads(raw[:n]), n, {}
    for o in doc["outputs"]:
        size = o["parameters"]["binary_data_size"]
        data = bytearray(raw[at:at + size])
        at += size
        dtype = TORCH_DTYPES[o["datatype"]]
        out[o["name"]] = torch.frombuffer(data, dtype=dtype).reshape(o["shape"]) \
            if size else torch.empty(o["shape"], dtype=dtype)
    assert at == len(raw)
    return out


def _v2(t):
    return {v: k for k, v in TORCH_DTYPES.items()}[t.dtype]


@pytest.mark.parametrize("rows", [1, 2])
def test_binary_outputs_of_every_datatype_equal_torch(url, rows):
    inputs = _examples(rows)
    out = _binary_infer(url, "kinds", [f"INPUT__{i}" for i in range(len(KINDS))], inputs)
    want = Kinds()(*inputs)
    assert [_v2(out[f"OUTPUT__{i}"]) for i in range(len(KINDS))] == KINDS
    for i, w in enumerate(want):
        torch.testing.assert_close(out[f"OUTPUT__{i}"], w, rtol=0, atol=0)


def test_a_large_binary_output_is_whole(url):
    x = torch.rand(*BIG)
    out = _binary_infer(url, "big", ["INPUT__0"], [x])
    torch.testing.assert_close(out["OUTPUT__0"], x * 2)


def _served_kinds(tmp_path) -> ServedModel:
    """The Kinds model traced into a one-version repository and served in process."""
    (tmp_path / "kinds" / "1").mkdir(parents=True)
    torch.jit.save(neuronmp.trace(Kinds(), _examples(2)), tmp_path / "kinds" / "1" / "model.pt")
    return ServedModel(load_model(str(tmp_path / "kinds")), 0)


def _address(buffer) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).__array_interface__["data"][0]


def test_binary_inputs_are_views_of_the_read_only_body_and_never_written(emulated,
                                                                         tmp_path):
    emulated("1x2")
    served = _served_kinds(tmp_path)
    try:
        inputs = _examples(2)
        header = b"{}"
        body = header + b"".join(t.view(torch.uint8).numpy().tobytes() for t in inputs)
        sent = bytes(bytearray(body))        # a second object to compare with after
        req = {"inputs": [{"name": f"INPUT__{i}", "datatype": _v2(t), "shape": list(t.shape),
                           "parameters": {"binary_data_size": t.numel() * t.element_size()}}
                          for i, t in enumerate(inputs)]}
        tensors = served.decode(req, memoryview(body)[len(header):], Registry())
        start, at = _address(body), len(header)
        for t, x in zip(tensors, inputs):
            assert t.data_ptr() == start + at        # on the body's bytes: no copy
            assert torch.equal(t, x)
            at += x.numel() * x.element_size()
        outs = served.server.infer(*tensors)
        for o, w in zip(outs, Kinds()(*inputs)):
            torch.testing.assert_close(o, w, rtol=0, atol=0)
        assert body == sent                          # the read-only body was not written
    finally:
        served.close()


def _send(url, model, header: bytes, payload: bytes):
    """One raw binary request; (status, header document, the binary data after it)."""
    req = urllib.request.Request(f"{url}/v2/models/{model}/infer", data=header + payload,
                                 headers={"Inference-Header-Content-Length": str(len(header)),
                                          "Content-Type": "application/octet-stream"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            n = int(r.headers["Inference-Header-Content-Length"])
            raw = r.read()
            return r.status, json.loads(raw[:n]), raw[n:]
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), b""


def _kinds_header(inputs, order, rid=None) -> bytes:
    doc = {"inputs": [{"name": f"INPUT__{i}", "datatype": _v2(inputs[i]),
                       "shape": list(inputs[i].shape),
                       "parameters": {"binary_data_size": inputs[i].numel()
                                      * inputs[i].element_size()}} for i in order],
           "parameters": {"binary_data_output": True}}
    if rid is not None:
        doc["id"] = rid
    return json.dumps(doc).encode()


def test_a_header_sent_again_runs_on_each_new_body(url):
    """The same header (inputs listed out of the model's order) with new tensors each
    time: every answer is the new tensors', with the request's id."""
    order = list(reversed(range(len(KINDS))))
    for seed in range(3):
        inputs = tuple(t[:2].contiguous() for t in _examples(2 + seed))   # new values
        header = _kinds_header(inputs, order, rid="same")
        payload = b"".join(inputs[i].contiguous().view(torch.uint8).numpy().tobytes()
                           for i in order)
        status, doc, raw = _send(url, "kinds", header, payload)
        assert status == 200, doc
        assert doc["id"] == "same"
        at = 0
        for o, want in zip(doc["outputs"], Kinds()(*inputs)):
            size = o["parameters"]["binary_data_size"]
            got = torch.frombuffer(bytearray(raw[at:at + size]),
                                   dtype=TORCH_DTYPES[o["datatype"]]).reshape(o["shape"])
            at += size
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_header_sent_again_with_too_few_bytes_is_refused_naming_the_input(url):
    inputs = _examples(2)
    order = list(range(len(KINDS)))
    header = _kinds_header(inputs, order)
    payload = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in inputs)
    assert _send(url, "kinds", header, payload)[0] == 200
    status, doc, _ = _send(url, "kinds", header, payload[:-1])
    assert status == 400
    assert "INPUT__7" in doc["error"] and "binary_data_size" in doc["error"]
    assert _send(url, "kinds", header, payload)[0] == 200   # and the header still runs


def test_only_all_binary_headers_without_shm_regions_are_prepared(emulated, tmp_path):
    emulated("1x2")
    served = _served_kinds(tmp_path)
    try:
        inputs = _examples(2)
        header = _kinds_header(inputs, range(len(KINDS)))
        req = json.loads(header)
        binary = memoryview(b"".join(t.view(torch.uint8).numpy().tobytes() for t in inputs))
        served.prepare(header, req, {}, binary)
        got = served.prepared[header].inputs(binary)
        for t, x in zip(got, inputs):
            assert torch.equal(t, x)
        assert served.prepared[header].inputs(binary[:-1]) is None   # length differs
        shm = dict(req, outputs=[{"name": "OUTPUT__0", "parameters": {
            "shared_memory_region": "r", "shared_memory_byte_size": 24}}])
        served.prepare(b"shm", shm, {}, binary)
        as_json = dict(req, inputs=[dict(t, parameters={}, data=[0]) for t in req["inputs"]])
        served.prepare(b"json", as_json, {}, binary)
        assert set(served.prepared) == {header}
    finally:
        served.close()
