"""neuronmp-serve against a real client (tritonclient.http), one server per module.

The repository holds three models on four emulated cores:
  mlp     no config (derived from the trace), traced at batch 4, two cores
  named   config.pbtxt with the forward's argument names, one core
  slow    config.json: batch 1, 300 ms of device time (the queue tests set up their
          state while one runs: 80 ms of it on a loaded host), two priority levels (the
          default 2) with a queue of 1 each, one core
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np
import psutil
import pytest
import torch

from neuronmp.launch.launcher import free_port

tritonclient_http = pytest.importorskip("tritonclient.http")
shm_utils = pytest.importorskip("tritonclient.utils.shared_memory")
from tritonclient.utils import InferenceServerException  # noqa: E402

_MARK = "NEURONMP_TEST_SHARED_SERVER"
try:
    import tritonclient.grpc as tritonclient_grpc
    _GRPC = True
except ImportError:   # tritonclient[grpc] is optional: the gRPC tests skip without it
    _GRPC = False


class Named(torch.nn.Module):
    def forward(self, image, scale):
        return image * scale, image.sum(dim=1, keepdim=True)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 3)).eval()


def _make_repository(root: str) -> None:
    """Traced in a child process, so this test process starts no runtime of its own."""
    code = f"""
import os, torch, neuronmp, json
root = {root!r}
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).eval()
os.makedirs(f"{{root}}/mlp/1")
torch.jit.save(neuronmp.trace(mlp, torch.rand(4, 16)), f"{{root}}/mlp/1/model.pt")
class Named(torch.nn.Module):
    def forward(self, image, scale):
        return image * scale, image.sum(dim=1, keepdim=True)
os.makedirs(f"{{root}}/named/3")
torch.jit.save(neuronmp.trace(Named(), (torch.rand(2, 5), torch.rand(2, 5))),
               f"{{root}}/named/3/model.pt")
os.makedirs(f"{{root}}/slow/1")
torch.jit.save(neuronmp.trace(torch.nn.Identity(), torch.rand(1, 4)), f"{{root}}/slow/1/model.pt")
neuronmp.shutdown()
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_RT_")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    with open(f"{root}/named/config.pbtxt", "w") as f:
        f.write("""
name: "named"
max_batch_size: 2
input [ { name: "scale" data_type: TYPE_FP32 dims: [ 5 ] },
        { name: "image" data_type: TYPE_FP32 dims: [ 5 ] } ]
output [ { name: "scaled" data_type: TYPE_FP32 dims: [ 5 ] },
         { name: "total" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
""")
    with open(f"{root}/mlp/config.json", "w") as f:
        json.dump({"max_batch_size": 4, "instance_group": [{"count": 2}]}, f)
    with open(f"{root}/slow/config.json", "w") as f:
        json.dump({"max_batch_size": 1,
                   "dynamic_batching": {"max_queue_delay_microseconds": 0,
                                        "priority_levels": 2, "default_priority_level": 2,
                                        "default_queue_policy": {"max_queue_size": 1}},
                   "parameters": {"device_time_us": {"string_value": "300000"}}}, f)


class _PortTaken(AssertionError):
    """The server could not bind a port picked for it: another socket took it first."""


class Server:
    def __init__(self, repo: str, extra_env=None, args=()):
        # a port found free can still be taken (another process binding the same
        # pick) before the server binds it: that start is retried on new ports
        for attempt in range(3):
            try:
                return self._start(repo, extra_env, args)
            except _PortTaken:
                if attempt == 2:
                    raise

    def _start(self, repo: str, extra_env, args) -> None:
        self.rundir = tempfile.mkdtemp(prefix="nmp-serve-test-", dir="/dev/shm")
        self.port, self.metrics_port, self.grpc_port = free_port(), free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_RT_")}
        env.update(NEURONMP_RUNTIME_DIR=self.rundir, NEURONMP_TOPOLOGY="1x4", **{_MARK: "1"},
                   **(extra_env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "neuronmp.serve", "--model-repository", repo,
             "--http-port", str(self.port), "--metrics-port", str(self.metrics_port),
             "--grpc-port", str(self.grpc_port if _GRPC else 0),
             "--host", "127.0.0.1", "--grace", "20", *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        self.url = f"127.0.0.1:{self.port}"
        try:
            self._wait_ready()
        except BaseException:   # a server that did not start leaves nothing behind either
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()
            shutil.rmtree(self.rundir, ignore_errors=True)
            raise
        self.client = tritonclient_http.InferenceServerClient(self.url, concurrency=8)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 90
        while not self._ready():
            if self.proc.poll() is not None:
                out = self.proc.communicate()
                if "cannot listen" in out[1] and "in use" in out[1]:
                    raise _PortTaken(out)
                raise AssertionError(f"neuronmp-serve exited: {out}")
            assert time.monotonic() < deadline, "neuronmp-serve not ready within 90 s"
            time.sleep(0.1)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.url}/v2/health/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def tree(self):
        try:
            return [self.proc.pid] + [p.pid for p in
                                      psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> int:
        """SIGTERM, then check that nothing is left: processes, segments, locks."""
        tree = self.tree()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=30)
        finally:
            self.client.close()
            os.killpg(self.proc.pid, signal.SIGKILL) if self.proc.poll() is None else None
        self.proc.communicate()
        deadline = time.monotonic() + 5
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                  for p in tree[1:]) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in tree[1:] if psutil.pid_exists(p)
                and psutil.Process(p).status() != "zombie"]
        shm = os.listdir(os.path.join(self.rundir, "shm")) \
            if os.path.isdir(os.path.join(self.rundir, "shm")) else []
        shutil.rmtree(self.rundir, ignore_errors=True)
        assert not left, f"processes left after neuronmp-serve exited: {left}"
        assert not shm, f"segments left: {shm}"
        return code


def _input(name, array, binary=True):
    inp = tritonclient_http.InferInput(name, list(array.shape), "FP32")
    inp.set_data_from_numpy(array, binary_data=binary)
    return inp


def _status(exc: InferenceServerException) -> str:
    return str(exc.status())


# -- health, metadata, config -----------------------------------------------------------


def test_health_and_metadata(server):
    c = server.client
    assert c.is_server_live() and c.is_server_ready()
    meta = c.get_server_metadata()
    assert meta["name"] == "neuronmp"
    assert {"binary_tensor_data", "system_shared_memory"} <= set(meta["extensions"])
    m = c.get_model_metadata("mlp")
    assert m["inputs"] == [{"name": "INPUT__0", "datatype": "FP32", "shape": [-1, 16]}]
    assert m["outputs"] == [{"name": "OUTPUT__0", "datatype": "FP32", "shape": [-1, 3]}]
    assert c.is_model_ready("named", "3") and not c.is_model_ready("named", "1")
    cfg = c.get_model_config("mlp")
    assert cfg["max_batch_size"] == 4 and len(cfg["instance_group"][0]["neuron_cores"]) == 2
    named = c.get_model_config("named")
    assert [t["name"] for t in named["output"]] == ["scaled", "total"]
    with pytest.raises(InferenceServerException) as err:
        c.get_model_metadata("nope")
    assert _status(err.value) == "404" and "nope" in str(err.value)


# -- inference ---------------------------------------------------------------------------


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_equals_torch(server, binary):
    x = np.random.rand(3, 16).astype(np.float32)
    out = tritonclient_http.InferRequestedOutput("OUTPUT__0", binary_data=binary)
    result = server.client.infer("mlp", [_input("INPUT__0", x, binary)], outputs=[out])
    with torch.no_grad():
        expected = _mlp()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), expected, rtol=1e-5, atol=1e-5)


def test_named_inputs_and_outputs_follow_the_forward(server):
    image = np.random.rand(2, 5).astype(np.float32)
    scale = np.full((2, 5), 3.0, np.float32)
    # binary inputs in another order than the config's: each gets its own bytes
    result = server.client.infer("named", [_input("image", image), _input("scale", scale)],
                                 model_version="3")
    np.testing.assert_allclose(result.as_numpy("scaled"), image * 3, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("total"), image.sum(1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("shape, dtype, says", [
    ((2, 15), "FP32", "shape [2, 15] does not match the model's [1..4, 16]"),
    ((5, 16), "FP32", "batch of 5 rows"),
    ((2, 16), "FP64", "datatype 'FP64', but the model takes FP32"),
])
def test_a_wrong_shape_or_dtype_is_400_naming_the_tensor(server, shape, dtype, says):
    inp = tritonclient_http.InferInput("INPUT__0", list(shape), dtype)
    inp.set_data_from_numpy(np.zeros(shape, np.float64 if dtype == "FP64" else np.float32))
    with pytest.raises(InferenceServerException) as err:
        server.client.infer("mlp", [inp])
    assert _status(err.value) == "400"
    assert "INPUT__0" in str(err.value) and says in str(err.value)


def test_an_unknown_input_and_a_missing_one_are_400(server):
    with pytest.raises(InferenceServerException, match="no such input") as err:
        server.client.infer("mlp", [_input("INPUT__9", np.zeros((1, 16), np.float32))])
    assert _status(err.value) == "400"
    with pytest.raises(InferenceServerException, match="'image': missing"):
        server.client.infer("named", [_input("scale", np.zeros((1, 5), np.float32))])


# -- system shared memory ----------------------------------------------------------------


def test_shared_memory_round_trip(server):
    c = server.client
    x = np.random.rand(4, 16).astype(np.float32)
    key_in, key_out = f"/nmp_in_{os.getpid()}", f"/nmp_out_{os.getpid()}"
    h_in = shm_utils.create_shared_memory_region("in_region", key_in, x.nbytes)
    h_out = shm_utils.create_shared_memory_region("out_region", key_out, 4 * 3 * 4)
    try:
        shm_utils.set_shared_memory_region(h_in, [x])
        c.register_system_shared_memory("in_region", key_in, x.nbytes)
        c.register_system_shared_memory("out_region", key_out, 4 * 3 * 4)
        names = {r["name"] for r in c.get_system_shared_memory_status()}
        assert {"in_region", "out_region"} <= names
        inp = tritonclient_http.InferInput("INPUT__0", [4, 16], "FP32")
        inp.set_shared_memory("in_region", x.nbytes)
        out = tritonclient_http.InferRequestedOutput("OUTPUT__0")
        out.set_shared_memory("out_region", 4 * 3 * 4)
        result = c.infer("mlp", [inp], outputs=[out])
        meta = result.get_output("OUTPUT__0")
        got = shm_utils.get_contents_as_numpy(h_out, np.float32, meta["shape"])
        with torch.no_grad():
            expected = _mlp()(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    finally:
        c.unregister_system_shared_memory()
        shm_utils.destroy_shared_memory_region(h_in)
        shm_utils.destroy_shared_memory_region(h_out)
    assert c.get_system_shared_memory_status() == []


def test_shared_memory_input_and_output_in_one_region_at_offsets(server):
    # the input is read in place and the output copied straight into the region:
    # each must land on its own bytes, and the bytes around them stay as they were
    c = server.client
    x = np.random.rand(2, 16).astype(np.float32)
    out_at, out_size = 8 + x.nbytes + 8, 2 * 3 * 4
    size = out_at + out_size + 8
    key = f"/nmp_one_{os.getpid()}"
    h = shm_utils.create_shared_memory_region("one", key, size)
    try:
        fill = np.full(size // 4, -7.0, dtype=np.float32)
        shm_utils.set_shared_memory_region(h, [fill])
        shm_utils.set_shared_memory_region(h, [x], offset=8)
        c.register_system_shared_memory("one", key, size)
        inp = tritonclient_http.InferInput("INPUT__0", [2, 16], "FP32")
        inp.set_shared_memory("one", x.nbytes, offset=8)
        out = tritonclient_http.InferRequestedOutput("OUTPUT__0")
        out.set_shared_memory("one", out_size, offset=out_at)
        meta = c.infer("mlp", [inp], outputs=[out]).get_output("OUTPUT__0")
        assert meta["parameters"]["shared_memory_byte_size"] == out_size
        whole = shm_utils.get_contents_as_numpy(h, np.float32, [size // 4])
        with torch.no_grad():
            expected = _mlp()(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(whole[out_at // 4:(out_at + out_size) // 4].reshape(2, 3),
                                   expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(whole[2:2 + x.size].reshape(2, 16), x)
        untouched = np.r_[0:2, 2 + x.size:out_at // 4, (out_at + out_size) // 4:size // 4]
        assert (whole[untouched] == -7.0).all()
    finally:
        c.unregister_system_shared_memory()
        shm_utils.destroy_shared_memory_region(h)

def _register(server, name, body):
    req = urllib.request.Request(
        f"http://{server.url}/v2/systemsharedmemory/region/{name}/register",
        data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, ""
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]


def test_bad_or_foreign_regions_are_refused(server, tmp_path):
    key = f"nmp_bad_{os.getpid()}"
    path = f"/dev/shm/{key}"
    with open(path, "wb") as f:
        f.write(b"\0" * 64)
    link = f"/dev/shm/{key}_link"
    os.symlink(path, link)
    try:
        assert _register(server, "r", {"key": "/nope_x", "byte_size": 8})[1].endswith(
            "no such region in /dev/shm")
        status, msg = _register(server, "r", {"key": f"/{key}", "offset": 60, "byte_size": 8})
        assert status == 400 and "past the end" in msg
        status, msg = _register(server, "r", {"key": f"/{key}_link", "byte_size": 8})
        assert status == 400 and "cannot be opened" in msg
        status, msg = _register(server, "r", {"key": "/../etc/passwd", "byte_size": 8})
        assert status == 400 and "not a /dev/shm name" in msg
        os.chmod(path, 0o666)
        status, msg = _register(server, "r", {"key": f"/{key}", "byte_size": 8})
        assert status == 400 and "other users may write it" in msg
        os.chmod(path, 0o600)
        assert _register(server, "r", {"key": f"/{key}", "offset": 32, "byte_size": 32}) == \
            (200, "")
        # a tensor that would reach past the registered 32 bytes is refused, not read
        inp = tritonclient_http.InferInput("INPUT__0", [1, 16], "FP32")
        inp.set_shared_memory("r", 64)
        with pytest.raises(InferenceServerException) as err:
            server.client.infer("mlp", [inp])
        assert _status(err.value) == "400" and "input 'INPUT__0'" in str(err.value)
        assert "outside the region's 32 bytes" in str(err.value)
        small = tritonclient_http.InferInput("INPUT__0", [1, 4], "FP32")   # 16 bytes
        small.set_shared_memory("r", 16, offset=24)
        with pytest.raises(InferenceServerException, match="offset 24 \\+ 16 bytes is outside"):
            server.client.infer("slow", [small])
    finally:
        server.client.unregister_system_shared_memory("r")
        os.unlink(link)
        os.unlink(path)


# -- queue bound, timeouts, metrics ------------------------------------------------------


def _slow_call(server, results, i, order=None, **kw):
    client = tritonclient_http.InferenceServerClient(server.url)
    try:
        x = np.full((1, 4), float(i), np.float32)
        r = client.infer("slow", [_input("INPUT__0", x)], **kw)
        results[i] = ("ok", r.as_numpy("OUTPUT__0"))
    except InferenceServerException as exc:
        results[i] = (_status(exc), str(exc))
    finally:
        client.close()
        if order is not None:
            order.append(i)


def test_queue_full_is_503_and_a_timeout_is_504(server):
    results = {}
    threads = [threading.Thread(target=_slow_call, args=(server, results, i))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    statuses = [results[i][0] for i in range(6)]
    assert "ok" in statuses and "503" in statuses, results
    assert all("queue" in results[i][1] for i in range(6) if results[i][0] == "503")
    for i in range(6):
        if results[i][0] == "ok":
            np.testing.assert_array_equal(results[i][1], np.full((1, 4), float(i)))
    # a request whose 20 ms timeout passes while a 300 ms call runs
    busy = threading.Thread(target=_slow_call, args=(server, results, 10))
    busy.start()
    _wait_running(server)
    _slow_call(server, results, 11, timeout=20_000)
    busy.join(30)
    assert results[10][0] == "ok"
    assert results[11][0] == "504", results[11]


def test_a_prepared_binary_requests_timeout_is_504_and_counted_as_the_first(server):
    # the second request of a header runs on the front end's fast path (its bytes
    # batched as they are, answered through a waiter): its timeout fails it the same way
    key = '{model="slow",version="1"}'
    before = _metrics(server)
    results = {}
    for i in (14, 15):
        _slow_call(server, results, i, timeout=20_000, request_id="prepared")
    assert results[14][0] == results[15][0] == "504", results
    assert all("request timed out after 0.02 s while" in results[i][1] for i in (14, 15))
    _slow_call(server, results, 16, request_id="prepared")
    assert results[16][0] == "ok"
    np.testing.assert_array_equal(results[16][1], np.full((1, 4), 16.0))
    after = _metrics(server)
    assert after["nv_inference_request_failure" + key] == \
        before.get("nv_inference_request_failure" + key, 0) + 2


def test_an_idle_servers_request_times_out_and_is_counted_like_any(server):
    # nothing queued or running: the request goes straight to a core, and its
    # 20 ms timeout still passes during the 300 ms call
    key = '{model="slow",version="1"}'
    before = _metrics(server)
    results = {}
    _slow_call(server, results, 12, timeout=20_000)
    assert results[12][0] == "504" and "while running" in results[12][1], results[12]
    _slow_call(server, results, 13)                  # after it, served as before
    assert results[13][0] == "ok"
    np.testing.assert_array_equal(results[13][1], np.full((1, 4), 13.0))
    after = _metrics(server)
    for name, more in (("nv_inference_request_failure", 1),
                       ("nv_inference_request_success", 1)):
        assert after[name + key] == before.get(name + key, 0) + more, name
    assert after["nv_inference_exec_count" + key] >= \
        before.get("nv_inference_exec_count" + key, 0) + 2     # both ran
    assert after["nv_inference_compute_infer_duration_us" + key] > \
        before.get("nv_inference_compute_infer_duration_us" + key, 0)


def test_a_shm_output_region_too_small_or_out_of_bounds_is_refused_and_untouched(server):
    c = server.client
    x = np.random.rand(4, 16).astype(np.float32)   # the traced batch: it runs alone
    key = f"/nmp_small_{os.getpid()}"
    h = shm_utils.create_shared_memory_region("small_out", key, 64)
    sentinel = np.full(16, -5.0, dtype=np.float32)
    try:
        shm_utils.set_shared_memory_region(h, [sentinel])
        c.register_system_shared_memory("small_out", key, 40)   # 48 bytes are needed
        for size, offset, words in ((32, 0, "cannot hold"), (48, 0, "outside the region"),
                                    (48, 8, "outside the region")):
            out = tritonclient_http.InferRequestedOutput("OUTPUT__0")
            out.set_shared_memory("small_out", size, offset=offset)
            with pytest.raises(InferenceServerException) as err:
                c.infer("mlp", [_input("INPUT__0", x)], outputs=[out])
            assert _status(err.value) == "400" and words in str(err.value), str(err.value)
            assert (shm_utils.get_contents_as_numpy(h, np.float32, [16]) == -5.0).all()
    finally:
        c.unregister_system_shared_memory("small_out")
        shm_utils.destroy_shared_memory_region(h)


def test_a_shm_output_of_a_request_that_timed_out_is_whole_or_untouched(server):
    # an idle server's request has its answer written into the region where the core's
    # answer is read (here before its 300 ms are up); after the 504 the region holds
    # what it held or the whole output, and nothing is written into it any more
    c = server.client
    x = np.arange(4, dtype=np.float32).reshape(1, 4) + 0.5
    key = f"/nmp_late_{os.getpid()}"
    h = shm_utils.create_shared_memory_region("late", key, 64)
    sentinel = np.full(16, -3.0, dtype=np.float32)
    try:
        shm_utils.set_shared_memory_region(h, [sentinel])
        c.register_system_shared_memory("late", key, 64)
        out = tritonclient_http.InferRequestedOutput("OUTPUT__0")
        out.set_shared_memory("late", 16, offset=16)
        with pytest.raises(InferenceServerException) as err:
            c.infer("slow", [_input("INPUT__0", x)], outputs=[out], timeout=20_000)
        assert _status(err.value) == "504", str(err.value)
        whole = shm_utils.get_contents_as_numpy(h, np.float32, [16])
        assert (whole[4:8] == x[0]).all() or (whole[4:8] == -3.0).all(), whole
        assert (np.r_[whole[:4], whole[8:]] == -3.0).all(), whole
        shm_utils.set_shared_memory_region(h, [sentinel])
        results = {}
        _slow_call(server, results, 14)   # answered on the same core after the timed-out one
        assert results[14][0] == "ok", results[14]
        assert (shm_utils.get_contents_as_numpy(h, np.float32, [16]) == -3.0).all()
        got = c.infer("slow", [_input("INPUT__0", x)], outputs=[out])
        assert got.get_output("OUTPUT__0")["parameters"]["shared_memory_byte_size"] == 16
        whole = shm_utils.get_contents_as_numpy(h, np.float32, [16])
        np.testing.assert_array_equal(whole[4:8], x[0])
        assert (np.r_[whole[:4], whole[8:]] == -3.0).all(), whole
    finally:
        c.unregister_system_shared_memory("late")
        shm_utils.destroy_shared_memory_region(h)


def _until(server, name, value):
    deadline = time.monotonic() + 20
    while _metrics(server).get(name + '{model="slow",version="1"}', 0) < value:
        assert time.monotonic() < deadline, f"{name} of slow never reached {value}"
        time.sleep(0.005)


def test_a_high_priority_request_overtakes_queued_low_ones(server):
    cfg = server.client.get_model_config("slow")["dynamic_batching"]
    assert cfg["priority_levels"] == 2 and cfg["default_priority_level"] == 2
    assert "schedule_policy" in server.client.get_server_metadata()["extensions"]
    results, order, threads = {}, [], {}
    batches = _metrics(server).get('nv_inference_exec_count{model="slow",version="1"}', 0)

    def call(i, **kw):
        threads[i] = threading.Thread(target=_slow_call, args=(server, results, i, order),
                                      kwargs=kw)
        threads[i].start()

    call(0)                                      # runs (300 ms)
    _until(server, "nv_inference_exec_count", batches + 1)
    call(1)                                      # the core's second lane: queued on it
    _until(server, "nv_inference_exec_count", batches + 2)
    call(2)                                      # default level 2: waits in its queue
    _until(server, "neuronmp_model_queue_depth", 1)
    _slow_call(server, results, 3)               # level 2's queue of 1 is full...
    _slow_call(server, results, 5, priority=7)   # (past the levels: the default, as Triton)
    for i in (3, 5):
        assert results[i][0] == "503" and "at priority level 2" in results[i][1], results
    call(4, priority=1)                          # ...level 1's is not, and goes first
    for t in threads.values():
        t.join(30)
    assert order == [0, 1, 4, 2], (order, results)
    for i in (0, 1, 2, 4):
        assert results[i][0] == "ok"
        np.testing.assert_array_equal(results[i][1], np.full((1, 4), float(i)))


def _metrics(server) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_counters_move(server):
    key = '{model="mlp",version="1"}'
    before = _metrics(server)
    server.client.infer("mlp", [_input("INPUT__0", np.zeros((3, 16), np.float32))])
    with pytest.raises(InferenceServerException):
        server.client.infer("mlp", [_input("INPUT__0", np.zeros((3, 15), np.float32))])
    after = _metrics(server)
    assert after["nv_inference_request_success" + key] == \
        before.get("nv_inference_request_success" + key, 0) + 1
    assert after["nv_inference_request_failure" + key] == \
        before.get("nv_inference_request_failure" + key, 0) + 1
    assert after["nv_inference_count" + key] >= before.get("nv_inference_count" + key, 0) + 1
    assert after["nv_inference_exec_count" + key] > before.get("nv_inference_exec_count" + key, 0)
    for name in ("nv_inference_request_duration_us", "nv_inference_queue_duration_us",
                 "nv_inference_compute_infer_duration_us"):
        assert after[name + key] > before.get(name + key, 0)
    assert any(k.startswith("neuronmp_core_busy_us{") for k in after)


# -- gRPC ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grpc_client(server):
    if not _GRPC:
        pytest.skip("tritonclient[grpc] is not installed")
    client = tritonclient_grpc.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    yield client
    client.close()


def _grpc_input(name, array):
    inp = tritonclient_grpc.InferInput(name, list(array.shape), "FP32")
    inp.set_data_from_numpy(array)
    return inp


_SECOND_GRPC = """
import asyncio, sys
from neuronmp.server import grpc_service
from neuronmp.server.infer import State
from neuronmp.server.metrics import Metrics

async def second():
    started = await grpc_service.start(State({}, Metrics()), "0.0.0.0", int(sys.argv[1]))
    await started.stop(None)

try:
    asyncio.run(second())
except OSError as exc:
    print(exc)
    sys.exit(3)
"""


def test_a_second_grpc_server_on_a_taken_port_fails_rather_than_sharing_it(server,
                                                                            grpc_client):
    # grpc's default SO_REUSEPORT let a second server bind the port too, and the
    # kernel then split the clients' connections between the two servers.  In a
    # child: grpc's core started in the test process broke Ray's start-up later on
    second = subprocess.run([sys.executable, "-c", _SECOND_GRPC, str(server.grpc_port)],
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 3, second
    assert re.search(f"gRPC cannot listen on .*:{server.grpc_port}", second.stdout), second
    assert grpc_client.is_server_live()


def test_grpc_health_metadata_config_and_infer(grpc_client):
    c = grpc_client
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("named", "3")
    assert not c.is_model_ready("named", "1") and not c.is_model_ready("nope")
    meta = c.get_server_metadata(as_json=True)
    assert meta["name"] == "neuronmp" and "schedule_policy" in meta["extensions"]
    m = c.get_model_metadata("mlp", as_json=True)
    assert m["inputs"] == [{"name": "INPUT__0", "datatype": "FP32", "shape": ["-1", "16"]}]
    cfg = c.get_model_config("slow", as_json=True)["config"]
    assert cfg["dynamic_batching"]["priority_levels"] == "2"
    x = np.random.rand(3, 16).astype(np.float32)
    result = c.infer("mlp", [_grpc_input("INPUT__0", x)])
    with torch.no_grad():
        expected = _mlp()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), expected, rtol=1e-5, atol=1e-5)
    image, scale = np.random.rand(2, 5).astype(np.float32), np.full((2, 5), 2.0, np.float32)
    result = c.infer("named", [_grpc_input("image", image), _grpc_input("scale", scale)],
                     outputs=[tritonclient_grpc.InferRequestedOutput("total")])
    np.testing.assert_allclose(result.as_numpy("total"), image.sum(1, keepdims=True),
                               rtol=1e-5)
    assert result.as_numpy("scaled") is None            # only the output asked for


def test_grpc_errors_carry_the_http_checks_as_grpc_codes(grpc_client):
    with pytest.raises(InferenceServerException) as err:
        grpc_client.infer("mlp", [_grpc_input("INPUT__0", np.zeros((2, 15), np.float32))])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "INPUT__0" in str(err.value) and "shape [2, 15] does not match" in str(err.value)
    with pytest.raises(InferenceServerException) as err:
        grpc_client.infer("nope", [_grpc_input("INPUT__0", np.zeros((1, 16), np.float32))])
    assert err.value.status() == "StatusCode.NOT_FOUND" and "nope" in str(err.value)


def test_grpc_shared_memory_round_trip(grpc_client):
    c = grpc_client
    x = np.random.rand(4, 16).astype(np.float32)
    key_in, key_out = f"/nmp_gin_{os.getpid()}", f"/nmp_gout_{os.getpid()}"
    h_in = shm_utils.create_shared_memory_region("gin", key_in, x.nbytes)
    h_out = shm_utils.create_shared_memory_region("gout", key_out, 4 * 3 * 4)
    try:
        shm_utils.set_shared_memory_region(h_in, [x])
        c.register_system_shared_memory("gin", key_in, x.nbytes)
        c.register_system_shared_memory("gout", key_out, 4 * 3 * 4)
        status = c.get_system_shared_memory_status(as_json=True)["regions"]
        assert {"gin", "gout"} <= set(status)
        inp = tritonclient_grpc.InferInput("INPUT__0", [4, 16], "FP32")
        inp.set_shared_memory("gin", x.nbytes)
        out = tritonclient_grpc.InferRequestedOutput("OUTPUT__0")
        out.set_shared_memory("gout", 4 * 3 * 4)
        result = c.infer("mlp", [inp], outputs=[out])
        shape = result.get_output("OUTPUT__0").shape
        got = shm_utils.get_contents_as_numpy(h_out, np.float32, shape)
        with torch.no_grad():
            expected = _mlp()(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        with pytest.raises(InferenceServerException) as err:
            c.register_system_shared_memory("bad", "/../etc/passwd", 8)
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "not a /dev/shm name" in str(err.value)
    finally:
        c.unregister_system_shared_memory()
        shm_utils.destroy_shared_memory_region(h_in)
        shm_utils.destroy_shared_memory_region(h_out)
    assert c.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}


def test_grpc_stream_answers_every_request_and_reports_errors_in_band(grpc_client):
    answers, lock, all_in = {}, threading.Lock(), threading.Event()
    xs = {str(i): np.random.rand(1 + i % 4, 16).astype(np.float32) for i in range(12)}

    def on_answer(result, error):
        with lock:
            if error is not None:
                answers["error"] = str(error)
            else:
                answers[result.get_response().id] = result.as_numpy("OUTPUT__0")
            if len(answers) == len(xs) + 1:
                all_in.set()

    grpc_client.start_stream(callback=on_answer)
    try:
        for rid, x in xs.items():
            if rid == "6":   # a bad one is answered in band; the stream goes on
                grpc_client.async_stream_infer("mlp", [_grpc_input(
                    "INPUT__0", np.zeros((1, 15), np.float32))], request_id="bad")
            grpc_client.async_stream_infer("mlp", [_grpc_input("INPUT__0", x)], request_id=rid)
        assert all_in.wait(30), f"answers for {sorted(answers)} only"
    finally:
        grpc_client.stop_stream()
    assert "INPUT__0" in answers.pop("error")
    with torch.no_grad():
        for rid, x in xs.items():
            np.testing.assert_allclose(answers[rid], _mlp()(torch.from_numpy(x)).numpy(),
                                       rtol=1e-5, atol=1e-5)


def test_grpc_queue_full_and_timeout_map_to_their_codes(server, grpc_client):
    results, threads = {}, []
    batches = _metrics(server).get('nv_inference_exec_count{model="slow",version="1"}', 0)
    for i, step in enumerate([("nv_inference_exec_count", batches + 1),    # runs
                              ("nv_inference_exec_count", batches + 2),    # on the core
                              ("neuronmp_model_queue_depth", 1)]):         # level 2 full
        threads.append(threading.Thread(target=_slow_call, args=(server, results, i)))
        threads[-1].start()
        _until(server, *step)
    x = np.zeros((1, 4), np.float32)
    with pytest.raises(InferenceServerException) as err:
        grpc_client.infer("slow", [_grpc_input("INPUT__0", x)])
    assert err.value.status() == "StatusCode.UNAVAILABLE"
    assert "queue is full" in str(err.value) and "priority level 2" in str(err.value)
    with pytest.raises(InferenceServerException) as err:   # level 1, 20 ms: expires
        grpc_client.infer("slow", [_grpc_input("INPUT__0", x)], priority=1, timeout=20_000)
    assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "timed out after 0.02 s" in str(err.value)
    for t in threads:
        t.join(30)
    assert [results[i][0] for i in range(3)] == ["ok"] * 3, results


# -- faults ------------------------------------------------------------------------------


def _workers(server):
    """{pid: process name} of the server's workers that are alive now."""
    out = {}
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if p.name().startswith("neuronmp-nc") and p.status() != psutil.STATUS_ZOMBIE:
                out[p.pid] = p.name()
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_worker_killed_under_load_fails_only_what_it_held(server):
    workers = _workers(server)
    assert workers
    x = np.random.rand(4, 16).astype(np.float32)
    outcomes = []

    def load():
        client = tritonclient_http.InferenceServerClient(server.url)
        for _ in range(30):
            try:
                client.infer("mlp", [_input("INPUT__0", x)])
                outcomes.append("ok")
            except InferenceServerException as exc:
                outcomes.append(_status(exc))
        client.close()

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    pid, name = next((p, n) for p, n in workers.items() if n in ("neuronmp-nc0", "neuronmp-nc1"))
    victim = psutil.Process(pid)
    victim.kill()
    for t in threads:
        t.join(60)
    assert len(outcomes) == 120 and set(outcomes) <= {"ok", "500"}
    assert outcomes.count("500") <= 2   # at most the batches the dead worker was running
    assert server.client.is_server_ready()
    victim.wait(timeout=10)
    deadline = time.monotonic() + 30
    while not [p for p, n in _workers(server).items() if n == name and p != pid]:
        assert time.monotonic() < deadline, "the killed worker was not replaced"
        time.sleep(0.05)
    result = server.client.infer("mlp", [_input("INPUT__0", x)])
    with torch.no_grad():
        expected = _mlp()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), expected, rtol=1e-5, atol=1e-5)


def _wait_depth(server, gauges: tuple, n: int, what: str) -> None:
    """Until the server's ``gauges`` (metric name prefixes) add up to ``n``."""
    deadline = time.monotonic() + 20
    while sum(v for k, v in _metrics(server).items() if k.startswith(gauges)) < n:
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _wait_running(server) -> None:
    """Until a request runs on some core: the next one then waits in the queue
    (a fixed sleep let the second request reach the queue of one first, on a busy host)."""
    _wait_depth(server, ("neuronmp_core_queue_depth",), 1,
                "the slow request never reached its core")


def _wait_accepted(server, n: int) -> None:
    """Until ``n`` requests are in the server, queued for a batch or on a core (a fixed
    sleep sent SIGTERM before a loaded host's server had read the second)."""
    _wait_depth(server, ("neuronmp_core_queue_depth", "neuronmp_model_queue_depth"), n,
                f"{n} requests never reached the server")


def test_sigterm_while_busy_loses_nothing_accepted(repo):
    s = Server(repo)
    results = {}
    threads = [threading.Thread(target=_slow_call, args=(s, results, i)) for i in range(2)]
    threads[0].start()
    _wait_running(s)
    threads[1].start()
    _wait_accepted(s, 2)   # the second queued behind the running one (300 ms)
    s.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    assert s.stop() == 0
    for i in range(2):
        assert results[i][0] == "ok", results
        np.testing.assert_array_equal(results[i][1], np.full((1, 4), float(i)))


def test_a_bad_config_fails_at_start_naming_file_and_field(tmp_path, repo):
    bad = tmp_path / "repo"
    shutil.copytree(repo, bad)
    (bad / "named" / "config.pbtxt").write_text(
        'max_batch_size: 2\ninput [ { name: "image" data_type: TYPE_FP99 dims: [5] } ]\n')
    res = subprocess.run([sys.executable, "-m", "neuronmp.serve", "--model-repository",
                          str(bad), "--http-port", str(free_port())],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "named/config.pbtxt: input[0].data_type = 'TYPE_FP99' is not valid" in res.stderr
    assert "TYPE_FP32" in res.stderr
    assert stat.S_ISDIR(os.stat(bad).st_mode)


@pytest.mark.parametrize("batching, field, accepted", [
    ({"priority_levels": 2, "default_priority_level": 3},
     "dynamic_batching.default_priority_level = 3", "1..priority_levels (2)"),
    ({"priority_levels": 2}, "dynamic_batching.default_priority_level = 0",
     "1..priority_levels (2)"),
    ({"priority_levels": 2, "default_priority_level": 1,
      "priority_queue_policy": {"3": {"max_queue_size": 1}}},
     "dynamic_batching.priority_queue_policy key = 3", "a priority level 1..priority_levels"),
    ({"preferred_batch_size": [2, 8]}, "dynamic_batching.preferred_batch_size = 8",
     "row counts in 1..max_batch_size (4)"),
], ids=["default-level-past", "default-level-0", "policy-level", "preferred-over-max"])
def test_priority_and_preferred_fields_are_checked(tmp_path, batching, field, accepted):
    from neuronmp.server.config import load_model
    from neuronmp.server.errors import ModelConfigError

    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.pt").write_bytes(b"")
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {"max_batch_size": 4, "dynamic_batching": batching}))
    with pytest.raises(ModelConfigError) as err:
        load_model(str(tmp_path / "m"))
    assert f"m/config.json: {field} is not valid" in str(err.value)
    assert accepted in str(err.value)


def test_level_queue_policies_read_from_pbtxt(tmp_path):
    from neuronmp.server.config import QueuePolicyConfig, load_model

    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.pt").write_bytes(b"")
    (tmp_path / "m" / "config.pbtxt").write_text("""
max_batch_size: 8
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy { max_queue_size: 16 }
  priority_queue_policy { key: 1 value { max_queue_size: 2 default_timeout_microseconds: 500 } }
  priority_queue_policy { key: 3 value { allow_timeout_override: false } }
}
""")
    cfg = load_model(str(tmp_path / "m"))
    assert cfg.preferred_batch_size == (4, 8) and cfg.default_priority_level == 2
    assert cfg.max_queue_size == 16
    assert cfg.priority_queue_policy == {
        1: QueuePolicyConfig(2, 500, True), 3: QueuePolicyConfig(None, 0, False)}
