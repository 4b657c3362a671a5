"""System shared memory as an adversary uses it, against a real neuronmp-serve (one per
module, started with a limit of 4 regions) and tritonclient: a region shrunk after
registration, too many regions, neuronmp's own segments; where the server listens by
default; which peers may use the extension.
"""
from __future__ import annotations

import contextlib
import http.client as http_client
import json
import os
import resource
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import types
import urllib.request

import numpy as np
import psutil
import pytest
from server.test_server import Server, _input, _register, _status

from neuronmp.launch.launcher import free_port

tritonclient_http = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

_LIMIT = 4


@pytest.fixture(scope="module")
def server(repo):
    s = Server(repo, extra_env={"NEURONMP_SHM_MAX_REGIONS": str(_LIMIT)})
    yield s
    assert s.stop() == 0


@contextlib.contextmanager
def _serving(repo: str, *args: str, env=None, preexec_fn=None):
    """A neuronmp-serve of its own with ``args`` (no --host unless given), stopped by
    SIGTERM at the end (exit 0 asserted); yields the process once it prints ready."""
    rundir = tempfile.mkdtemp(prefix="nmp-serve-test-", dir="/dev/shm")
    full = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_RT_")}
    full.update(NEURONMP_TOPOLOGY="1x4", NEURONMP_RUNTIME_DIR=rundir, **(env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "neuronmp.serve", "--model-repository",
                             repo, *args], env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=preexec_fn)
    try:
        line = proc.stdout.readline()   # "neuronmp-serve: ready on ..." once it listens
        assert "ready" in line, (line, proc.poll(), proc.poll() is not None and
                                 proc.communicate())
        yield proc
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
        shutil.rmtree(rundir, ignore_errors=True)
    assert proc.returncode == 0


def _file(key: str, data: bytes) -> str:
    path = f"/dev/shm/{key}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return path


def _alive(server) -> None:
    assert server.proc.poll() is None, server.proc.communicate()
    with urllib.request.urlopen(f"http://{server.url}/v2/health/live", timeout=10) as r:
        assert r.status == 200
    x = np.ones((4, 16), np.float32)
    assert server.client.infer("mlp", [_input("INPUT__0", x)]).as_numpy("OUTPUT__0").shape \
        == (4, 3)


def _shm_input(region: str, nbytes: int):
    inp = tritonclient_http.InferInput("INPUT__0", [4, 16], "FP32")
    inp.set_shared_memory(region, nbytes)
    return inp


def _shm_output(region: str, nbytes: int, offset: int = 0):
    out = tritonclient_http.InferRequestedOutput("OUTPUT__0")
    out.set_shared_memory(region, nbytes, offset=offset)
    return out


def test_a_region_shrunk_after_registration_is_refused_and_the_server_lives(server):
    x = np.random.rand(4, 16).astype(np.float32)
    key = f"nmp_shrink_{os.getpid()}"
    path = _file(key, x.tobytes() + b"\0" * 4096)
    c = server.client
    try:
        c.register_system_shared_memory("shrink", f"/{key}", x.nbytes + 4096)
        os.truncate(path, 0)   # the client's own file: it may shrink it at any time
        with pytest.raises(InferenceServerException) as err:
            c.infer("mlp", [_shm_input("shrink", x.nbytes)])
        assert _status(err.value) == "400" and "shrank" in str(err.value), str(err.value)
        with pytest.raises(InferenceServerException) as err:   # as an output
            c.infer("mlp", [_input("INPUT__0", x)], outputs=[_shm_output("shrink", 48, 4096)])
        assert _status(err.value) == "400" and "shrank" in str(err.value), str(err.value)
        _alive(server)
        os.truncate(path, x.nbytes + 4096)   # grown back: usable again
        got = c.infer("mlp", [_input("INPUT__0", x)], outputs=[_shm_output("shrink", 48)])
        assert got.get_output("OUTPUT__0")["parameters"]["shared_memory_byte_size"] == 48
    finally:
        c.unregister_system_shared_memory("shrink")
        os.unlink(path)


def test_a_region_shrinking_and_growing_under_requests_never_kills_the_server(server):
    # the window between the size check and the copy: a file that changes size all the
    # time, while requests read from it and write into it; each gets 200 or 400
    x = np.random.rand(4, 16).astype(np.float32)
    key = f"nmp_flap_{os.getpid()}"
    size = 1 << 20
    path = _file(key, x.tobytes() + b"\0" * (size - x.nbytes))
    c = server.client
    stop = threading.Event()

    def flap():
        fd = os.open(path, os.O_RDWR)
        try:
            while not stop.is_set():
                os.ftruncate(fd, 0)
                os.ftruncate(fd, size)
                os.pwrite(fd, x.tobytes(), 0)
        finally:
            os.close(fd)

    flapper = threading.Thread(target=flap)
    seen = set()
    try:
        c.register_system_shared_memory("flap", f"/{key}", size)
        flapper.start()
        for _ in range(150):
            try:
                c.infer("mlp", [_shm_input("flap", x.nbytes)],
                        outputs=[_shm_output("flap", 48, offset=size - 48)])
                seen.add("200")
            except InferenceServerException as exc:
                assert _status(exc) == "400", str(exc)
                seen.add("400")
            assert server.proc.poll() is None, server.proc.communicate()
    finally:
        stop.set()
        if flapper.ident is not None:
            flapper.join(30)
        if server.proc.poll() is None:
            c.unregister_system_shared_memory("flap")
        os.unlink(path)
    _alive(server)
    assert seen, "no request ran"


def test_past_the_region_limit_registration_is_a_kserve_error_and_the_server_serves(server):
    c = server.client
    paths = [_file(f"nmp_many_{os.getpid()}_{i}", b"\0" * 64) for i in range(_LIMIT + 1)]
    try:
        for i in range(_LIMIT):
            assert _register(server, f"many{i}", {"key": os.path.basename(paths[i]),
                                                  "byte_size": 64}) == (200, "")
        status, msg = _register(server, "one_more", {"key": os.path.basename(paths[-1]),
                                                     "byte_size": 64})
        assert status == 400 and f"at most {_LIMIT} regions" in msg, msg
        assert "NEURONMP_SHM_MAX_REGIONS" in msg
        _alive(server)
        c.unregister_system_shared_memory("many0")   # room again
        assert _register(server, "one_more", {"key": os.path.basename(paths[-1]),
                                              "byte_size": 64}) == (200, "")
    finally:
        c.unregister_system_shared_memory()
        for p in paths:
            os.unlink(p)


def _server_segment(server) -> str:
    shm = os.path.join(server.rundir, "shm")
    names = [n for n in sorted(os.listdir(shm)) if not n.endswith(".live")]
    assert names, os.listdir(shm)
    return os.path.join(shm, names[0])


def test_neuronmps_own_segments_are_refused_whatever_their_name(server):
    # by their name, and by what they are (a link to one under an innocent name)
    me = psutil.Process()
    lookalike = _file(f"nmp-{me.pid}-{int(me.create_time() * 100)}-0123456789abcdef",
                      b"\0" * 64)
    link = f"/dev/shm/innocent_{os.getpid()}"
    os.link(_server_segment(server), link)
    try:
        status, msg = _register(server, "own", {"key": os.path.basename(lookalike),
                                                "byte_size": 8})
        assert status == 400 and "neuronmp's own" in msg, msg
        status, msg = _register(server, "own", {"key": os.path.basename(link),
                                                "byte_size": 8})
        assert status == 400 and "neuronmp's own" in msg, msg
        assert server.client.get_system_shared_memory_status() == []
    finally:
        os.unlink(link)
        os.unlink(lookalike)


@pytest.mark.parametrize("peer, local", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("ipv4:127.0.0.1:50000", True), ("ipv6:[::1]:50000", True),
    (f"unix:uid={os.getuid()}", True), ("unix:uid=0", True), ("unix:uid=65534", False),
    ("unix:/run/x.sock", False),
    ("10.1.2.3", False), ("192.0.2.7", False), ("2001:db8::1", False),
    ("ipv4:192.0.2.7:50000", False), ("ipv6:[2001:db8::1]:5", False),
    ("ipv6:[::ffff:192.0.2.7]:5", False), (None, False), ("", False), ("nonsense", False),
])
def test_only_peers_on_this_host_may_use_shared_memory(peer, local):
    from neuronmp.server import shm
    from neuronmp.server.errors import SharedMemoryError

    if local:
        shm.check_peer("r", peer)
    else:
        with pytest.raises(SharedMemoryError, match="not on this host|not the owner"):
            shm.check_peer("r", peer)


def test_the_server_listens_on_loopback_unless_told_otherwise(repo):
    http, metrics, grpc = free_port(), free_port(), free_port()
    ports = {http, metrics, grpc}
    with _serving(repo, "--http-port", str(http), "--metrics-port", str(metrics),
                  "--grpc-port", str(grpc)) as proc:
        listening = {c.laddr.port: c.laddr.ip for c in
                     psutil.Process(proc.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port in ports}
    assert set(listening) == ports, listening
    assert set(listening.values()) <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, listening


def test_the_default_region_limit_keeps_a_1024_descriptor_server_accepting(repo):
    # the probe's case: under ulimit -n 1024, registrations used to take every
    # descriptor (from about the 996th region) and the listener could accept no more
    from neuronmp.server.shm import DEFAULT_MAX_REGIONS

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    http = free_port()
    paths = [_file(f"nmp_fd_{os.getpid()}_{i}", b"\0" * 8)
             for i in range(DEFAULT_MAX_REGIONS + 1)]
    try:
        with _serving(repo, "--http-port", str(http), "--grpc-port", "0",
                      "--metrics-port", "0", preexec_fn=low_limit):
            server = types.SimpleNamespace(url=f"127.0.0.1:{http}")
            for i, p in enumerate(paths[:-1]):
                assert _register(server, f"fd{i}", {"key": os.path.basename(p),
                                                    "byte_size": 8}) == (200, ""), i
            status, msg = _register(server, "fd_over", {"key": os.path.basename(paths[-1]),
                                                        "byte_size": 8})
            assert status == 400 and f"at most {DEFAULT_MAX_REGIONS} regions" in msg, msg
            # still accepting: many connections open at once, each answered
            conns = [http_client.HTTPConnection("127.0.0.1", http, timeout=30)
                     for _ in range(100)]
            for c in conns:
                c.request("GET", "/v2/health/live")
            assert [c.getresponse().status for c in conns] == [200] * 100
            for c in conns:
                c.close()
    finally:
        for p in paths:
            os.unlink(p)


def test_host_is_documented_with_its_risk():
    out = " ".join(subprocess.run([sys.executable, "-m", "neuronmp.serve", "--help"],
                                  capture_output=True, text=True, timeout=60).stdout.split())
    assert "default 127.0.0.1" in out and "network" in out, out


_PEER_CLIENT = r"""
import json, sys, urllib.request, urllib.error
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException
base, grpc_url, key = sys.argv[1:4]
def call(path, body=None):
    req = urllib.request.Request(base + path, data=None if body is None else
                                 json.dumps(body).encode(), method="POST" if body is not None
                                 or path.endswith("unregister") else "GET")
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return [r.status, r.read().decode()]
    except urllib.error.HTTPError as e:
        return [e.code, e.read().decode()]
out = {
    "register": call("/v2/systemsharedmemory/region/r/register", {"key": key, "byte_size": 64}),
    "status": call("/v2/systemsharedmemory/status"),
    "unregister": call("/v2/systemsharedmemory/unregister", {}),
    "infer_shm": call("/v2/models/slow/infer", {"inputs": [{
        "name": "INPUT__0", "datatype": "FP32", "shape": [1, 4],
        "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 16}}]}),
    "infer": call("/v2/models/slow/infer", {"inputs": [{
        "name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}),
}
try:
    grpcclient.InferenceServerClient(grpc_url).register_system_shared_memory("g", key, 64)
    out["grpc_register"] = "ok"
except InferenceServerException as e:
    out["grpc_register"] = [e.status(), e.message()]
print(json.dumps(out))
"""


def _ip(*args) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def other_host():
    """A network namespace joined to this one by a veth pair with IPv4 link-local
    addresses (169.254.77.1 here, .2 there): a client there is not on this host."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("a network namespace needs root and iproute2")
    ns, here, there = f"nmp{os.getpid()}", f"nmpa{os.getpid()}", f"nmpb{os.getpid()}"
    try:
        _ip("netns", "add", ns)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"no network namespace here: {exc.stderr.decode().strip()}")
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", ns)
        _ip("addr", "add", "169.254.77.1/30", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", ns, "addr", "add", "169.254.77.2/30", "dev", there)
        _ip("-n", ns, "link", "set", there, "up")
        yield ns
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_a_client_not_on_this_host_may_infer_but_never_use_shared_memory(repo, other_host):
    key = f"nmp_remote_{os.getpid()}"
    path = _file(key, b"\0" * 64)
    http, grpc = free_port(), free_port()
    try:
        with _serving(repo, "--host", "169.254.77.1", "--http-port", str(http),
                      "--grpc-port", str(grpc), "--metrics-port", "0"):
            res = subprocess.run(
                ["ip", "netns", "exec", other_host, sys.executable, "-c", _PEER_CLIENT,
                 f"http://169.254.77.1:{http}", f"169.254.77.1:{grpc}", key],
                capture_output=True, text=True, timeout=120)
    finally:
        os.unlink(path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    for what in ("register", "status", "unregister"):
        assert out[what][0] == 403 and "not on this host" in out[what][1], out
    assert out["infer_shm"][0] == 400 and "not on this host" in out["infer_shm"][1], out
    assert out["infer"][0] == 200, out
    assert out["grpc_register"][0] == "StatusCode.PERMISSION_DENIED", out
    assert "not on this host" in out["grpc_register"][1], out


class _UnixHTTP(http_client.HTTPConnection):
    def __init__(self, path: str):
        super().__init__("localhost", timeout=30)
        self._path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(self._path)


def _unix_post(path: str, url: str, doc) -> tuple:
    conn = _UnixHTTP(path)
    try:
        conn.request("POST", url, body=json.dumps(doc).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


_OTHER_USER = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("refused")
else:
    print("connected")
"""


def test_a_unix_socket_serves_shared_memory_to_the_regions_owner_alone(repo):
    folder = tempfile.mkdtemp(prefix="nmp-sock-")
    os.chmod(folder, 0o755)   # others may reach the socket: its own mode must stop them
    path = os.path.join(folder, "serve.sock")
    x = np.arange(4, dtype=np.float32) + 0.25
    key = f"nmp_unix_{os.getpid()}"
    region = _file(key, x.tobytes() + b"\0" * 16)
    try:
        with _serving(repo, "--http-port", str(free_port()), "--grpc-port", "0",
                      "--metrics-port", "0", "--unix-socket", path):
            st = os.stat(path)
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
            assert _unix_post(path, "/v2/systemsharedmemory/region/u/register",
                              {"key": key, "byte_size": 32}) == (200, "")
            status, text = _unix_post(path, "/v2/models/slow/infer", {
                "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4],
                            "parameters": {"shared_memory_region": "u",
                                           "shared_memory_byte_size": 16}}],
                "outputs": [{"name": "OUTPUT__0", "parameters": {
                    "shared_memory_region": "u", "shared_memory_byte_size": 16,
                    "shared_memory_offset": 16}}]})
            assert status == 200, text
            with open(region, "rb") as f:
                np.testing.assert_array_equal(np.frombuffer(f.read(), np.float32)[4:], x)
            system_python = shutil.which("python3", path="/usr/bin:/bin")
            if os.geteuid() == 0 and system_python:
                # another user (with an interpreter it may run): the socket's mode
                # refuses the connection
                other = subprocess.run([system_python, "-c", _OTHER_USER, path],
                                       capture_output=True, text=True, timeout=60,
                                       preexec_fn=lambda: os.setuid(65534))
                assert other.stdout.strip() == "refused", other
        assert not os.path.lexists(path)   # removed at the end
    finally:
        os.unlink(region)
        shutil.rmtree(folder, ignore_errors=True)


def test_a_unix_socket_path_that_exists_is_refused_not_replaced(repo, tmp_path):
    taken = tmp_path / "taken.sock"
    taken.write_text("not ours")
    res = subprocess.run([sys.executable, "-m", "neuronmp.serve", "--model-repository", repo,
                          "--http-port", str(free_port()), "--grpc-port", "0",
                          "--metrics-port", "0", "--unix-socket", str(taken)],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "NEURONMP_TOPOLOGY": "1x4"})
    assert res.returncode == 2 and f"--unix-socket {taken} exists" in res.stderr, res
    assert taken.read_text() == "not ours"


_DISPLACED = """
import os, signal, sys
import numpy as np
from neuronmp.server.errors import SharedMemoryError
from neuronmp.server.shm import Registry
key = sys.argv[1]
path = "/dev/shm/" + key
x = np.arange(4096, dtype=np.uint8)
registry = Registry(limit=4)
registry.register("r", key, 0, x.nbytes)
region = registry.get("r")
region.write(0, x)                                   # through the guard: installed now
signal.signal(signal.SIGBUS, signal.SIG_DFL)         # displaced by someone else's handler
from neuronmp.shm import _guard
assert not _guard.ready()
region.write(0, x[::-1].copy())                      # pwrite instead
assert bytes(region.read(0, x.nbytes)) == x[::-1].tobytes()   # pread instead
os.truncate(path, 16)
try:
    region.read(0, x.nbytes)
except SharedMemoryError as exc:
    print("refused:", exc)
registry.unregister()
"""


def test_a_displaced_sigbus_guard_leaves_regions_served_through_the_descriptor(procs):
    # the guard gives way to a SIGBUS handler installed after it: the regions' copies
    # go through pread/pwrite, as safe and still checked, never through the mapping
    key = f"nmp_displaced_{os.getpid()}"
    path = _file(key, b"\0" * 4096)
    try:
        p = procs.popen([sys.executable, "-c", _DISPLACED, key], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)
        out, err = p.communicate(timeout=120)
    finally:
        os.unlink(path)
    assert p.returncode == 0, err
    assert "refused:" in out and "shrank to 16 bytes" in out, out
