"""Benchmark: neuronmp-serve over HTTP against other serving stacks, shared memory
against HTTP, and aiohttp against another HTTP library.

Every server runs alone (the host has 2 CPUs), started and stopped by this tool; the
load comes from separate client processes (asyncio + aiohttp client sessions, closed
loop: each of N connections sends a request and waits for its answer).  One Python
client process tops out below the fastest servers, so N connections are split over
ceil(N / 32) processes (--client-procs), started together on one clock; their
latencies are merged before the percentiles are taken.

1. Throughput and latency, 1 / 16 / 64 concurrent clients, single-sample requests
   ([1, 512] fp32) to bench_dp's MLP:
     neuronmp   neuronmp-serve, the MLP traced at batch 32 with batch buckets
                1,2,4,8,16,24,32 (--buckets; "none": every batch padded to 32), dynamic
                batching (max_batch_size 32, max_queue_delay 2 ms), instance_group count 2
                (the host's emulated cores); KServe v2 with binary tensor data, and
                the same with JSON tensors (--compare-optlevel3 adds neuronmp-O3: the
                MLP traced with compiler_args="--optlevel 3", its Linear weights laid
                out for the matmul)
     litserve   LitServe, LitAPI(max_batch_size=32, batch_timeout=2 ms), 2 workers
     mosec      mosec, append_worker(num=2, max_batch_size=32, max_wait_time=2 ms)
     ray        Ray Serve (if installed), 2 replicas, @serve.batch(32, 2 ms)
   (tools/http_peers.py holds the peers; each computes with the plain torch module.)
   Server CPU per request is split into the HTTP front end (neuronmp-serve's process,
   mosec's Rust binary) and the model workers (neuronmp's core workers, the peers'
   Python worker processes).
2. Shared memory against binary HTTP for a 1 MiB input and output (x + 1 traced at
   [1, 262144] fp32): p50 per request from tritonclient.http in a client process,
   with tritonclient.utils.shared_memory regions and with binary tensors.
3. The HTTP library: requests per CPU-second of the server process for a small JSON
   infer (the MLP) and a 1 MiB binary infer, for neuronmp-serve as built (httptools)
   and for a minimal KServe handler on the same served models in aiohttp and in
   starlette + uvicorn (--libraries adds aiohttp on uvloop); the same processes also
   answer without a model, which measures HTTP alone.

    python tools/bench_http.py [--seconds 6] [--rounds 1] [--peers litserve,mosec,ray]
                               [--client-procs auto|N] [--plot PATH] [--buckets LIST|none]
                               [--compare-buckets LIST] [--compare-aiohttp]
                               [--compare-optlevel3]

Progress goes to stderr, the tables to stdout; the exit status is 1 when one of issue
N's targets is missed (each printed with held or MISSED, the missed ones also on
stderr): at 64 clients at least 1.0x the best peer's throughput, a p99 at most 1.5x
its and server CPU per request (whole process tree) at most 1.5x its; at 1 client a
p50 no worse; and shared memory 3x faster than binary HTTP (the shm section).
A peer that is not installed, or does not start, is skipped.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import psutil

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)

FEATURES = 512
BATCH = 32
BIG = 262144          # fp32 elements: 1 MiB
CLIENTS = (1, 16, 64)
HEADER_LEN = "Inference-Header-Content-Length"


# -- wire formats ------------------------------------------------------------------------

class Codec:
    """One request format: a path, headers, a body for a sample, a sample from a reply."""

    path = "/"
    headers: Dict[str, str] = {}

    def body(self, x: np.ndarray) -> bytes:
        raise NotImplementedError

    def parse(self, data: bytes, headers) -> np.ndarray:
        raise NotImplementedError

    def check(self, data: bytes, headers) -> None:
        """The load loop's check of a 200 reply (its status is checked before): what a
        format can check without decoding it.  The JSON formats must decode."""
        self.parse(data, headers)


class KServeBinary(Codec):
    """KServe v2 with the binary tensor data extension, in and out."""

    def __init__(self, model: str, shape, out_bytes: int = 40):
        self.path = f"/v2/models/{model}/infer"
        self.shape = list(shape)
        self.out_bytes = out_bytes

    def body(self, x):
        raw = x.astype(np.float32).tobytes()
        header = json.dumps({
            "inputs": [{"name": "INPUT__0", "shape": self.shape, "datatype": "FP32",
                        "parameters": {"binary_data_size": len(raw)}}],
            "outputs": [{"name": "OUTPUT__0", "parameters": {"binary_data": True}}],
        }).encode()
        self.headers = {HEADER_LEN: str(len(header)),
                        "Content-Type": "application/octet-stream"}
        return header + raw

    def parse(self, data, headers):
        n = int(headers[HEADER_LEN])
        json.loads(data[:n])
        return np.frombuffer(data, dtype=np.float32, offset=n)

    def check(self, data, headers):
        # as cheap as the raw formats' check: the header's length and the output's
        # size, not its JSON (check_answer decodes one reply in full before a load)
        if len(data) - int(headers[HEADER_LEN]) != self.out_bytes:
            raise ValueError(f"a reply of {len(data)} bytes, header "
                             f"{headers[HEADER_LEN]}: not {self.out_bytes} output bytes")


class KServeFixed(KServeBinary):
    """bench_frontends.py's servers: the binary KServe request of model "m", answered
    with a fixed header and 10 fp32.  mosec cannot set a reply header: without
    Inference-Header-Content-Length the last 40 bytes are the output."""

    def __init__(self, path: str):
        super().__init__("m", [1, FEATURES])
        self.path = path

    def parse(self, data, headers):
        n = int(headers.get(HEADER_LEN, len(data) - 40))
        json.loads(data[:n])
        out = np.frombuffer(data, dtype=np.float32, offset=n)
        if out.size != 10:
            raise ValueError(f"a reply of {len(data)} bytes, header {n}: not 10 fp32")
        return out

    check = parse   # bench_frontends compares front ends: both decode the same


class KServeJSON(Codec):
    """KServe v2 with JSON tensors, in and out."""

    headers = {"Content-Type": "application/json"}

    def __init__(self, model: str, shape):
        self.path = f"/v2/models/{model}/infer"
        self.shape = list(shape)

    def body(self, x):
        return json.dumps({"inputs": [{"name": "INPUT__0", "shape": self.shape,
                                       "datatype": "FP32", "data": x.ravel().tolist()}]}).encode()

    def parse(self, data, headers):
        return np.asarray(json.loads(data)["outputs"][0]["data"], dtype=np.float32)


class LitServeJSON(Codec):
    path = "/predict"
    headers = {"Content-Type": "application/json"}

    def body(self, x):
        return json.dumps({"input": x.ravel().tolist()}).encode()

    def parse(self, data, headers):
        return np.asarray(json.loads(data)["output"], dtype=np.float32)


class RawFP32(Codec):
    headers = {"Content-Type": "application/octet-stream"}

    def __init__(self, path: str):
        self.path = path

    def body(self, x):
        return x.astype(np.float32).tobytes()

    def parse(self, data, headers):
        return np.frombuffer(data, dtype=np.float32)

    def check(self, data, headers):
        if len(data) != 40:
            raise ValueError(f"a reply of {len(data)} bytes: not 10 fp32")


def codec(name: str) -> Codec:
    return {
        "kserve-binary": lambda: KServeBinary("mlp", [1, FEATURES]),
        "kserve-json": lambda: KServeJSON("mlp", [1, FEATURES]),
        "kserve-binary-1mib": lambda: KServeBinary("ident", [1, BIG], 4 * BIG),
        "null-json": lambda: KServeJSON("null", [1, FEATURES]),
        "null-binary": lambda: KServeBinary("null", [1, FEATURES], 4 * FEATURES),
        "null-binary-1mib": lambda: KServeBinary("null", [1, BIG], 4 * BIG),
        "litserve-json": LitServeJSON,
        "mosec-raw": lambda: RawFP32("/inference"),
        "ray-raw": lambda: RawFP32("/"),
        "fixed-kserve": lambda: KServeFixed("/v2/models/m/infer"),
        "fixed-mosec": lambda: KServeFixed("/inference"),
    }[name]()


# -- the load client (its own process) ------------------------------------------------------

def client_main(spec: dict) -> None:
    """One load-client process: ``concurrency`` connections, closed loop.  Prints "ready"
    when set up, reads the start time (time.monotonic, shared by every process on the
    host) from stdin, loads for warm + seconds from it, then prints one JSON line with
    the latencies of the requests wholly inside the measured window."""
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_client(spec))


async def _client(spec: dict) -> None:
    import aiohttp

    c = codec(spec["codec"])
    url = spec["url"] + c.path
    shape = (1, BIG) if spec["codec"].endswith("1mib") else (1, FEATURES)
    rng = np.random.default_rng(spec.get("seed", 0))
    bodies = [c.body(rng.random(shape, dtype=np.float32)) for _ in range(16)]
    headers = dict(c.headers)
    n, warm, seconds = spec["concurrency"], spec["warm"], spec["seconds"]
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    start = float(await loop.run_in_executor(None, sys.stdin.readline))
    t_go = start + warm                 # loop.time() is time.monotonic() on asyncio/uvloop
    t_stop = t_go + seconds
    done: List[tuple] = []
    errors: List[str] = []
    me = psutil.Process()
    cpu = [0.0, 0.0]

    def mark(i: int) -> None:
        cpu[i] = sum(me.cpu_times()[:2])

    loop.call_at(t_go, mark, 0)
    loop.call_at(t_stop, mark, 1)

    async def one(i: int, session) -> None:
        k = i
        await asyncio.sleep(max(0.0, start - loop.time()))
        while loop.time() < t_stop:
            body = bodies[k % len(bodies)]
            k += 1
            t0 = time.perf_counter()
            try:
                async with session.post(url, data=body, headers=headers) as r:
                    data = await r.read()
                    if r.status != 200:
                        errors.append(f"{r.status} {data[:200]!r}")
                        await asyncio.sleep(0.01)
                        continue
                    c.check(data, r.headers)
            except aiohttp.ClientError as exc:
                errors.append(repr(exc))
                await asyncio.sleep(0.01)
                continue
            t1 = time.perf_counter()
            done.append((loop.time(), t1 - t0))

    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        await asyncio.gather(*(one(i, session) for i in range(n)))
    print(json.dumps({
        "window_us": [round(1e6 * lat) for end, lat in done
                      if t_go <= end - lat and end <= t_stop],
        "requests": sum(1 for end, _ in done if t_go <= end <= t_stop),
        "errors": len(errors), "first_error": errors[0] if errors else None,
        "client_cpu_s": cpu[1] - cpu[0]}), flush=True)


def merge_clients(parts: List[dict], seconds: float) -> dict:
    """The client processes' results as one: requests and CPU summed, percentiles of
    every latency together."""
    window = sorted(lat for p in parts for lat in p["window_us"])
    out = {"requests": sum(p["requests"] for p in parts),
           "errors": sum(p["errors"] for p in parts),
           "first_error": next((p["first_error"] for p in parts if p["first_error"]), None),
           "client_cpu_s": sum(p["client_cpu_s"] for p in parts),
           "client_procs": len(parts)}
    out["rps"] = out["requests"] / seconds
    if window:
        out["p50_ms"] = 1e-3 * window[len(window) // 2]
        out["p99_ms"] = 1e-3 * window[min(len(window) - 1, int(len(window) * 0.99))]
    return out


def role(proc: psutil.Process, root: int) -> str:
    """Which part of a server a process of its tree is: "front" (the process that
    answers HTTP: neuronmp-serve's root, mosec's Rust binary), "workers" (the processes
    that run the model: neuronmp's core workers, the peers' spawned Python workers) or
    "other" (a peer's Python parent, forkservers, resource trackers)."""
    name = proc.name()
    if name.startswith("neuronmp-nc"):
        return "workers"
    cmdline = proc.cmdline()
    if proc.pid == root:
        return "front" if "neuronmp.serve" in cmdline else "other"
    if cmdline and os.path.basename(cmdline[0]) == "mosec":
        return "front"
    return "workers" if any("spawn_main" in a for a in cmdline) else "other"


ROLES = ("front", "workers", "other")


def cpu_by_role(pid: int) -> Dict[str, float]:
    """CPU seconds (user + system) of a server's process tree, by role (see role)."""
    out = dict.fromkeys(ROLES, 0.0)
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            out[role(p, pid)] += sum(p.cpu_times()[:2])
        except (psutil.NoSuchProcess, psutil.ZombieProcess, IndexError):
            pass
    return out


def tree_cpu(pid: int, front_only: bool = False) -> float:
    """CPU seconds (user + system) of a process and, unless front_only, its descendants."""
    try:
        root = psutil.Process(pid)
        procs = [root] if front_only else [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            total += sum(p.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


#: how many connections one load-client process drives at most when --client-procs is
#: "auto" (one Python process tops out below the fastest servers: see
#: docs/guides/batch-buckets.md)
CLIENTS_PER_PROC = 32
_client_procs = "auto"


def client_procs(concurrency: int) -> int:
    if _client_procs == "auto":
        return max(1, -(-concurrency // CLIENTS_PER_PROC))
    return max(1, min(int(_client_procs), concurrency))


def drive(url: str, codec_name: str, concurrency: int, seconds: float, warm: float,
          server_pid: int) -> dict:
    """Load url from client processes (each driving its share of the connections, all
    started at one moment); their results merged, with the server's CPU in the window."""
    procs = client_procs(concurrency)
    shares = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
    clients = []
    try:
        for i, share in enumerate(shares):
            spec = {"url": url, "codec": codec_name, "concurrency": share, "seed": i,
                    "seconds": seconds, "warm": warm}
            clients.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--client", json.dumps(spec)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for p in clients:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a load client failed to start (exit {p.wait()})")
        start = time.monotonic() + 0.05
        for p in clients:
            p.stdin.write(f"{start}\n")
            p.stdin.flush()
        cpu = {}
        for word, at in (("go", start + warm), ("stop", start + warm + seconds)):
            time.sleep(max(0.0, at - time.monotonic()))
            cpu[word] = (tree_cpu(server_pid), tree_cpu(server_pid, front_only=True),
                         thread_switches(server_pid), cpu_by_role(server_pid))
        parts = []
        for p in clients:
            out, _ = p.communicate(timeout=seconds + warm + 120)
            lines = [x for x in out.splitlines() if x.startswith("{")]
            if p.returncode or not lines:
                raise RuntimeError(f"a load client failed (exit {p.returncode})")
            parts.append(json.loads(lines[-1]))
    finally:
        for p in clients:
            if p.poll() is None:
                p.kill()
                p.wait()
    result = merge_clients(parts, seconds)
    result["seconds"] = seconds
    result["server_cpu_s"] = cpu["stop"][0] - cpu["go"][0]
    result["front_cpu_s"] = cpu["stop"][1] - cpu["go"][1]
    result["front_switches"] = cpu["stop"][2] - cpu["go"][2]
    for k in ROLES:   # a process that left the tree in the window counts as 0 (rare)
        result[f"{k}_role_cpu_s"] = cpu["stop"][3][k] - cpu["go"][3][k]
    return result


def thread_switches(pid: int) -> int:
    """Context switches (voluntary and not) summed over the threads of one process:
    each is a hand-off between threads or a wait, tens of microseconds on a VM."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}") else ():
        try:
            with open(f"/proc/{pid}/task/{task}/status") as f:
                for line in f:
                    if "ctxt_switches:" in line:
                        total += int(line.split()[-1])
        except (OSError, ValueError):
            pass
    return total


# -- servers --------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("NEURON_RT_")}


class Server:
    """A server process group started by this tool; stop() leaves nothing behind."""

    def __init__(self, name: str, argv: List[str], ready_path: str, env=None,
                 runtime_dir: Optional[str] = None, startup: float = 120.0,
                 ready_body: bytes = b"", scratch: Optional[str] = None):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.runtime_dir = runtime_dir
        self.scratch = scratch
        self.ready_body = ready_body
        self.log = tempfile.TemporaryFile(mode="w+")
        argv = [a.replace("{port}", str(self.port)) for a in argv]
        self.proc = subprocess.Popen(argv, env=env or _clean_env(), stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.pids = {self.proc.pid}
        deadline = time.monotonic() + startup
        try:
            while not self._ready(ready_path):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {self.proc.returncode}:\n{self.output()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} not ready in {startup:g} s:\n{self.output()}")
                self._remember_tree()
                time.sleep(0.2)
            self._remember_tree()
        except BaseException:
            self.stop()
            raise

    def _ready(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as r:
                return r.status == 200 and self.ready_body in r.read()
        except (OSError, urllib.error.URLError):
            return False

    def _remember_tree(self) -> None:
        try:
            self.pids |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:]

    def post(self, path: str, body: bytes, headers: dict):
        req = urllib.request.Request(self.url + path, data=body, headers=headers)
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read(), r.headers

    def stop(self) -> None:
        """SIGTERM, a grace period, then SIGKILL for anything of the tree still there."""
        self._remember_tree()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self._alive():
            time.sleep(0.1)
        for pid in self._alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        if self.runtime_dir and os.path.isdir(self.runtime_dir):
            left = [os.path.join(d, f) for d, _, fs in os.walk(self.runtime_dir) for f in fs]
            if left:
                print(f"warning: {self.name} left {left} behind (removed)", file=sys.stderr)
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
        self.log.close()

    def _alive(self) -> List[int]:
        alive = []
        for pid in self.pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive


def neuronmp_env() -> tuple:
    rundir = tempfile.mkdtemp(prefix="nmp-bench-http-", dir="/dev/shm")
    env = _clean_env()
    env["NEURONMP_RUNTIME_DIR"] = rundir
    return env, rundir


def start_neuronmp(repo: str, frontend: str = "auto") -> Server:
    env, rundir = neuronmp_env()
    return Server("neuronmp-serve", [sys.executable, "-m", "neuronmp.serve",
                                     "--model-repository", repo, "--http-port", "{port}",
                                     "--metrics-port", "0", "--grpc-port", "0",
                                     "--host", "127.0.0.1", "--http-frontend", frontend],
                  "/v2/health/ready", env=env, runtime_dir=rundir)


def start_minimal(repo: str, library: str) -> Server:
    env, rundir = neuronmp_env()
    return Server(f"minimal {library}", [sys.executable, os.path.abspath(__file__),
                                         "--minimal", library, "--repo", repo,
                                         "--port", "{port}"],
                  "/v2/health/ready", env=env, runtime_dir=rundir)


def start_peer(peer: str, weights: str, workers: int, delay_ms: float,
               extra: Sequence[str] = ()) -> Server:
    scratch = tempfile.mkdtemp(prefix="bench-http-peer-")
    argv = [sys.executable, os.path.join(TOOLS, "http_peers.py"), peer, "--port", "{port}",
            "--weights", weights, "--workers", str(workers), "--max-batch", str(BATCH),
            "--delay-ms", str(delay_ms), "--temp-dir", scratch, *extra]
    # Ray's proxy answers before the application is deployed: wait for its route
    ready, body = {"litserve": ("/health", b""), "mosec": ("/", b""),
                   "ray": ("/-/routes", b'"/"')}[peer]
    return Server(peer, argv, ready, ready_body=body, scratch=scratch)


# -- the model repository -----------------------------------------------------------------

_TRACE = """
import os, sys, torch, neuronmp
sys.path.insert(0, {tools!r})
from bench_dp import mlp
root = {root!r}
torch.manual_seed(0)
net = mlp()
torch.save(net.state_dict(), os.path.join(root, "mlp_weights.pt"))
os.makedirs(os.path.join(root, "traced"))
torch.jit.save(neuronmp.trace(net, torch.rand({batch}, {features}), batch_buckets={buckets}),
               os.path.join(root, "traced", "mlp.pt"))
if {padded}:
    torch.jit.save(neuronmp.trace(net, torch.rand({batch}, {features})),
                   os.path.join(root, "traced", "mlp_padded.pt"))
if {alt}:
    torch.jit.save(neuronmp.trace(net, torch.rand({batch}, {features}), batch_buckets={alt}),
                   os.path.join(root, "traced", "mlp_alt.pt"))
if {o3}:
    torch.jit.save(neuronmp.trace(net, torch.rand({batch}, {features}), batch_buckets={buckets},
                                  compiler_args="--optlevel 3"),
                   os.path.join(root, "traced", "mlp_o3.pt"))
class PlusOne(torch.nn.Module):
    def forward(self, x):
        return x + 1
torch.jit.save(neuronmp.trace(PlusOne(), torch.rand(1, {big})),
               os.path.join(root, "traced", "ident.pt"))
neuronmp.shutdown()
"""


def make_repositories(root: str, cores: int, delay_us: int,
                      buckets: Optional[Sequence[int]] = None, padded: bool = False,
                      alt: Optional[Sequence[int]] = None, o3: bool = False) -> dict:
    """Trace in a child process (with a runtime directory of its own, removed after);
    the MLP with ``buckets`` (a graph per batch size) when given, with ``padded``
    a second repository whose MLP has none, with ``alt`` one whose MLP has those, with
    ``o3`` one whose MLP is traced with ``compiler_args="--optlevel 3"`` (its Linear
    weights laid out for the matmul)."""
    env, rundir = neuronmp_env()
    try:
        subprocess.run([sys.executable, "-c", _TRACE.format(
            tools=TOOLS, root=root, batch=BATCH, features=FEATURES, big=BIG,
            buckets=tuple(buckets) if buckets else None, padded=padded,
            alt=tuple(alt) if alt else None, o3=o3)],
            check=True, env=env, timeout=300)
    finally:
        shutil.rmtree(rundir, ignore_errors=True)

    def add(repo: str, name: str, cfg: dict, traced: Optional[str] = None) -> None:
        os.makedirs(os.path.join(repo, name, "1"))
        shutil.copy(os.path.join(root, "traced", f"{traced or name}.pt"),
                    os.path.join(repo, name, "1", "model.pt"))
        with open(os.path.join(repo, name, "config.json"), "w") as f:
            json.dump(cfg, f)

    mlp_cfg = {"max_batch_size": BATCH,
               "dynamic_batching": {"max_queue_delay_microseconds": delay_us}}
    if buckets:
        mlp_cfg["parameters"] = {"batch_buckets": {"string_value": ",".join(map(str, buckets))}}
    serve = os.path.join(root, "repo_serve")
    add(serve, "mlp", dict(mlp_cfg, instance_group=[{"count": cores}]))
    # the HTTP-library and shared-memory runs: both models, a core each
    lib = os.path.join(root, "repo_lib")
    add(lib, "mlp", dict(mlp_cfg, instance_group=[{"count": 1}]))
    add(lib, "ident", {"max_batch_size": 1, "instance_group": [{"count": 1}]})
    out = {"serve": serve, "lib": lib, "weights": os.path.join(root, "mlp_weights.pt")}
    if padded:
        out["serve_padded"] = os.path.join(root, "repo_serve_padded")
        plain = {k: v for k, v in mlp_cfg.items() if k != "parameters"}
        add(out["serve_padded"], "mlp", dict(plain, instance_group=[{"count": cores}]),
            traced="mlp_padded")
    if alt:
        out["serve_alt"] = os.path.join(root, "repo_serve_alt")
        add(out["serve_alt"], "mlp", dict(mlp_cfg, instance_group=[{"count": cores}],
                                          parameters={"batch_buckets": {
                                              "string_value": ",".join(map(str, alt))}}),
            traced="mlp_alt")
    if o3:
        out["serve_o3"] = os.path.join(root, "repo_serve_o3")
        add(out["serve_o3"], "mlp", dict(mlp_cfg, instance_group=[{"count": cores}]),
            traced="mlp_o3")
    return out


def expected_mlp(weights: str, x: np.ndarray) -> np.ndarray:
    import torch
    from bench_dp import mlp

    net = mlp()
    net.load_state_dict(torch.load(weights))
    with torch.inference_mode():
        return net(torch.from_numpy(x.reshape(1, -1))).numpy().ravel()


def batch_counts(server: Server) -> tuple:
    """(rows, batches) run so far by neuronmp-serve's mlp, from its /metrics."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    found = {}
    for line in text.splitlines():
        for name in ("nv_inference_count", "nv_inference_exec_count"):
            if line.startswith(name + "{") and 'model="mlp"' in line:
                found[name] = float(line.rsplit(" ", 1)[1])
    return found.get("nv_inference_count", 0.0), found.get("nv_inference_exec_count", 0.0)


def check_answer(server: Server, codec_name: str, want_fn) -> None:
    c = codec(codec_name)
    shape = (1, BIG) if codec_name.endswith("1mib") else (1, FEATURES)
    x = np.random.default_rng(1).random(shape, dtype=np.float32)
    data, headers = server.post(c.path, c.body(x), c.headers)
    got = c.parse(data, headers)
    want = want_fn(x)
    if not np.allclose(got.ravel(), want.ravel(), rtol=1e-4, atol=1e-4):
        raise AssertionError(f"{server.name} ({codec_name}) answered {got.ravel()[:4]}..., "
                             f"expected {want.ravel()[:4]}...")


# -- section 1: throughput and latency against the peers -----------------------------------

def run_throughput(repos: dict, peers: List[str], cores: int, delay_ms: float,
                   seconds: float, warm: float, clients, rounds: int,
                   formats: Sequence[str] = ("kserve-binary", "kserve-json"),
                   aiohttp: bool = False) -> List[dict]:
    """Every server in turn, ``rounds`` times over (medians are taken by median_rows)."""
    rows = []
    want = lambda x: expected_mlp(repos["weights"], x)  # noqa: E731
    plan = [("neuronmp", formats)] + \
        ([("neuronmp-aiohttp", ["kserve-binary"])] if aiohttp else []) + \
        ([("neuronmp-padded", ["kserve-binary"])] if "serve_padded" in repos else []) + \
        ([("neuronmp-alt", ["kserve-binary"])] if "serve_alt" in repos else []) + \
        ([("neuronmp-O3", ["kserve-binary"])] if "serve_o3" in repos else []) + \
        [(p, [{"litserve": "litserve-json", "mosec": "mosec-raw", "ray": "ray-raw"}[p]])
         for p in peers]
    for rnd, (name, codecs) in ((rnd, p) for rnd in range(rounds) for p in plan):
        try:
            if name.startswith("neuronmp"):
                server = start_neuronmp(
                    repos[{"neuronmp-padded": "serve_padded", "neuronmp-alt": "serve_alt",
                           "neuronmp-O3": "serve_o3"}.get(name, "serve")],
                    "aiohttp" if name == "neuronmp-aiohttp" else "auto")
            else:
                server = start_peer(name, repos["weights"], cores, delay_ms)
        except RuntimeError as exc:
            lines = [x for x in str(exc).splitlines() if x.strip()]
            print(f"skipped {name}: {lines[0]} {lines[-1] if len(lines) > 1 else ''}",
                  file=sys.stderr)
            continue
        try:
            for cname in codecs:
                check_answer(server, cname, want)
                for n in clients:
                    before = batch_counts(server) if name.startswith("neuronmp") else None
                    r = drive(server.url, cname, n, seconds, warm, server.proc.pid)
                    if before is not None:
                        after = batch_counts(server)
                        r["rows_per_batch"] = (after[0] - before[0]) / max(after[1] - before[1], 1)
                    r.update(server=name, codec=cname, clients=n, round=rnd)
                    rows.append(r)
                    print(f"  {name:9} {cname:14} {n:3} clients: {r['rps']:7.0f} req/s  "
                          f"p50 {r.get('p50_ms', float('nan')):6.2f} ms  "
                          f"p99 {r.get('p99_ms', float('nan')):6.2f} ms  "
                          f"errors {r['errors']}", file=sys.stderr, flush=True)
        finally:
            server.stop()
    return rows


def median_rows(rows: List[dict]) -> List[dict]:
    """One row per (server, format, clients): the median of each figure over the rounds."""
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        groups.setdefault((r["server"], r["codec"], r["clients"]), []).append(r)
    out = []
    for (server, cname, n), rs in groups.items():
        m = {"server": server, "codec": cname, "clients": n, "rounds": len(rs),
             "errors": sum(r["errors"] for r in rs), "seconds": rs[0]["seconds"]}
        for k in ("rps", "requests", "p50_ms", "p99_ms", "server_cpu_s", "client_cpu_s",
                  "client_procs",
                  "front_cpu_s", "rows_per_batch", "per_cpu", "front_switches"):
            vals = [r[k] for r in rs if r.get(k) is not None]
            if vals:
                m[k] = statistics.median(vals)
        for k in ("server_cpu_s", "client_cpu_s", *(f"{r}_role_cpu_s" for r in ROLES)):
            # per request, then the median
            vals = [r[k] / max(r["requests"], 1) for r in rs if k in r]
            if vals:
                m[k + "_per_req"] = statistics.median(vals)
        out.append(m)
    return out


CONFIGS = {
    "neuronmp-padded": "neuronmp-padded: the same neuronmp-serve, the MLP traced at {batch} "
                       "without buckets (each batch padded to {batch} rows)",
    "neuronmp-alt": "neuronmp-alt: the same neuronmp-serve, the MLP traced with batch buckets "
                    "{alt} (--compare-buckets)",
    "neuronmp-O3": "neuronmp-O3: the same neuronmp-serve, the MLP traced with "
                   "compiler_args=\"--optlevel 3\" (Linear weights laid out for the matmul; "
                   "outputs equal torch's up to fp32 rounding) (--compare-optlevel3)",
    "neuronmp-aiohttp": "neuronmp-aiohttp: the same neuronmp-serve with --http-frontend "
                        "aiohttp (the aiohttp application)",
    "neuronmp": "neuronmp-serve: 1 HTTP process (its httptools front end unless "
                "--http-frontend says otherwise) + {cores} core workers; "
                "max_batch_size {batch}, max_queue_delay {delay_us} us (a partial batch "
                "waits it even on an idle server, as Triton's does), instance_group "
                "count {cores}, traced at {batch}; {buckets}",
    "litserve": "LitServe {ver}: {cores} API processes (uvicorn; LitServe's default, one "
                "per worker) + {cores} workers (workers_per_device={cores}); "
                "LitAPI(max_batch_size={batch}, batch_timeout={delay_s}); eager torch on "
                "the batch's rows",
    "mosec": "mosec {ver}: Rust front end + {cores} workers; append_worker(num={cores}, "
             "max_batch_size={batch}, max_wait_time={delay_ms:g} ms); eager torch",
    "ray": "Ray Serve {ver}: HTTP proxy + {cores} replicas (ray.init(num_cpus=2)); "
           "@serve.batch(max_batch_size={batch}, batch_wait_timeout_s={delay_s}); eager torch",
}
FORMATS = {
    "kserve-binary": "KServe v2, binary tensors", "kserve-json": "KServe v2, JSON tensors",
    "litserve-json": "JSON", "mosec-raw": "raw fp32 body", "ray-raw": "raw fp32 body",
}


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def render_throughput(rows: List[dict], cores: int, delay_ms: float, clients,
                      buckets: Optional[Sequence[int]] = None,
                      alt: Optional[Sequence[int]] = None) -> str:
    def fmt(v, spec):
        return format(v, spec) if v is not None else "-"

    servers = []
    for r in rows:
        if (r["server"], r["codec"]) not in servers:
            servers.append((r["server"], r["codec"]))
    lines = ["Configurations (all on this host's CPUs, one torch thread per worker):"]
    for name in dict.fromkeys(s for s, _ in servers):
        ver = _version({"neuronmp": "neuronmp", "neuronmp-padded": "neuronmp",
                        "neuronmp-O3": "neuronmp",
                        "neuronmp-aiohttp": "neuronmp", "neuronmp-alt": "neuronmp",
                        "ray": "ray"}.get(name, name))
        lines.append("  " + CONFIGS[name].format(
            cores=cores, batch=BATCH, delay_us=round(delay_ms * 1000), delay_s=delay_ms / 1000,
            delay_ms=delay_ms, ver=ver, alt=",".join(map(str, alt or ())),
            buckets=f"batch buckets {','.join(map(str, buckets))}" if buckets
            else "each batch padded to 32 rows"))
    best = _best_peer(rows, clients)
    procs = sorted({round(r.get("client_procs", 1)) for r in rows})
    lines.append(f"  load: {'/'.join(map(str, procs))} client process(es) per point "
                 f"(at most {CLIENTS_PER_PROC} connections each unless --client-procs)")
    lines += ["", "| server | wire format | clients | req/s | p50 ms | p99 ms | "
              "server CPU ms/req | of it HTTP front end | of it workers | "
              "client CPU ms/req | rows/batch | x best peer req/s | "
              "p50 / best peer | p99 / best peer | server CPU/req / best peer |",
              "|" + "---|" * 15]
    for n in clients:
        for s, cname in servers:
            r = next((r for r in rows if r["server"] == s and r["codec"] == cname
                      and r["clients"] == n), None)
            if r is None:
                continue
            b = best.get(n)
            ours = b and s.startswith("neuronmp")
            vs = (f"{r['rps'] / b['rps']:.2f}", f"{r['p50_ms'] / b['p50_ms']:.2f}",
                  f"{r['p99_ms'] / b['p99_ms']:.2f}",
                  f"{r['server_cpu_s_per_req'] / b['server_cpu_s_per_req']:.2f}"
                  ) if ours else ("",) * 4
            lines.append(
                f"| {s} | {FORMATS[cname]} | {n} | {r['rps']:.0f} | "
                f"{fmt(r.get('p50_ms'), '.2f')} | {fmt(r.get('p99_ms'), '.2f')} | "
                f"{1e3 * r['server_cpu_s_per_req']:.3f} | "
                f"{fmt(_ms(r.get('front_role_cpu_s_per_req')), '.3f')} | "
                f"{fmt(_ms(r.get('workers_role_cpu_s_per_req')), '.3f')} | "
                f"{1e3 * r['client_cpu_s_per_req']:.3f} | "
                f"{fmt(r.get('rows_per_batch'), '.1f')} | {' | '.join(vs)} |"
                + (f" ({r['errors']} errors)" if r["errors"] else ""))
    if best:
        lines.append("")
        lines.append("best peer per row: " + ", ".join(
            f"{n} clients {b['server']}" for n, b in best.items()))
    for r in rows:
        if r["server"].startswith("neuronmp") and r.get("front_cpu_s") is not None:
            lines.append(f"{r['server']}, {FORMATS[r['codec']]}, {r['clients']} clients: its "
                         f"HTTP process used {r['front_cpu_s'] / r['seconds']:.2f} of a CPU, "
                         f"{1e3 * r['front_cpu_s'] / max(r['requests'], 1):.3f} ms and "
                         f"{r['front_switches'] / max(r['requests'], 1):.1f} thread switches "
                         "per request")
    return "\n".join(lines)


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else 1e3 * seconds


def _best_peer(rows: List[dict], clients) -> Dict[int, dict]:
    """Per client count: the peer with the highest throughput (64), or lowest p50 (1)."""
    best = {}
    for n in clients:
        peers = [r for r in rows if not r["server"].startswith("neuronmp") and r["clients"] == n
                 and "p50_ms" in r]
        if peers:
            key = (lambda r: r["p50_ms"]) if n == 1 else (lambda r: -r["rps"])
            best[n] = min(peers, key=key)
    return best


#: the serving targets at 64 clients, against the best peer of the same run
TARGET_RPS, TARGET_P99, TARGET_CPU = 1.0, 1.5, 1.5


def check_targets(rows: List[dict], clients) -> List[Tuple[str, bool]]:
    """The serving targets, each (what was measured against what, held): at 64 clients
    at least 1.0x the best peer's req/s, a p99 at most 1.5x its, server CPU per
    request at most 1.5x its; at 1 client a p50 at most the best peer's."""
    checks = []
    best = _best_peer(rows, clients)
    ours = {r["clients"]: r for r in rows
            if r["server"] == "neuronmp" and r["codec"] == "kserve-binary"}
    if 64 in best and 64 in ours:
        o, b = ours[64], best[64]
        ratio = o["rps"] / b["rps"]
        checks.append((f"64 clients: {o['rps']:.0f} req/s = {ratio:.2f}x {b['server']}'s "
                       f"{b['rps']:.0f} (target >= {TARGET_RPS}x)", ratio >= TARGET_RPS))
        ratio = o["p99_ms"] / b["p99_ms"]
        checks.append((f"64 clients: p99 {o['p99_ms']:.2f} ms = {ratio:.2f}x {b['server']}'s "
                       f"{b['p99_ms']:.2f} (target <= {TARGET_P99}x)", ratio <= TARGET_P99))
        if o.get("server_cpu_s_per_req") and b.get("server_cpu_s_per_req"):
            ratio = o["server_cpu_s_per_req"] / b["server_cpu_s_per_req"]
            checks.append((f"64 clients: server CPU {1e3 * o['server_cpu_s_per_req']:.3f} "
                           f"ms/req = {ratio:.2f}x {b['server']}'s "
                           f"{1e3 * b['server_cpu_s_per_req']:.3f} (target <= "
                           f"{TARGET_CPU}x)", ratio <= TARGET_CPU))
    if 1 in best and 1 in ours:
        o, b = ours[1], best[1]
        checks.append((f"1 client: p50 {o['p50_ms']:.2f} ms against {b['server']}'s "
                       f"{b['p50_ms']:.2f} (target: at most)", o["p50_ms"] <= b["p50_ms"]))
    return checks


# -- section 2: shared memory against binary HTTP ---------------------------------------------

def shm_client_main(spec: dict) -> None:
    """p50/p99 per request of x + 1 on 1 MiB through tritonclient.http: shm regions, then
    binary tensors, alternating in rounds; prints one JSON line."""
    import tritonclient.http as th
    import tritonclient.utils.shared_memory as shm

    url, seconds, rounds = spec["url"], spec["seconds"], spec["rounds"]
    client = th.InferenceServerClient(url)
    nbytes = BIG * 4
    x = np.random.default_rng(2).random((1, BIG), dtype=np.float32)
    tag = f"bench_http_{os.getpid()}"
    h_in = shm.create_shared_memory_region(f"{tag}_in", f"/{tag}_in", nbytes)
    h_out = shm.create_shared_memory_region(f"{tag}_out", f"/{tag}_out", nbytes)
    try:
        client.register_system_shared_memory(f"{tag}_in", f"/{tag}_in", nbytes)
        client.register_system_shared_memory(f"{tag}_out", f"/{tag}_out", nbytes)
        shm_in = th.InferInput("INPUT__0", [1, BIG], "FP32")
        shm_in.set_shared_memory(f"{tag}_in", nbytes)
        shm_out = th.InferRequestedOutput("OUTPUT__0", binary_data=True)
        shm_out.set_shared_memory(f"{tag}_out", nbytes)

        def via_shm():
            shm.set_shared_memory_region(h_in, [x])
            client.infer("ident", [shm_in], outputs=[shm_out])
            return shm.get_contents_as_numpy(h_out, np.float32, [1, BIG])

        def via_http():
            inp = th.InferInput("INPUT__0", [1, BIG], "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            out = th.InferRequestedOutput("OUTPUT__0", binary_data=True)
            return client.infer("ident", [inp], outputs=[out]).as_numpy("OUTPUT__0")

        times = {"shm": [], "http": []}
        for name, fn in (("shm", via_shm), ("http", via_http)):
            if not np.array_equal(fn(), x + 1):
                raise AssertionError(f"{name}: wrong answer")
        for _ in range(rounds):
            for name, fn in (("shm", via_shm), ("http", via_http)):
                end = time.perf_counter() + seconds / rounds / 2
                while True:
                    t0 = time.perf_counter()
                    fn()
                    t1 = time.perf_counter()
                    times[name].append(t1 - t0)
                    if t1 > end:
                        break
        out = {}
        for name, ts in times.items():
            ts.sort()
            out[name] = {"n": len(ts), "p50_ms": 1e3 * ts[len(ts) // 2],
                         "p99_ms": 1e3 * ts[min(len(ts) - 1, int(len(ts) * 0.99))]}
        print(json.dumps(out), flush=True)
    finally:
        try:
            client.unregister_system_shared_memory()
        finally:
            shm.destroy_shared_memory_region(h_in)
            shm.destroy_shared_memory_region(h_out)
            client.close()


def run_shm(server: Server, seconds: float) -> dict:
    spec = {"url": server.url[len("http://"):], "seconds": seconds, "rounds": 4}
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--shm-client",
                        json.dumps(spec)], capture_output=True, text=True, timeout=300)
    if p.returncode:
        raise RuntimeError(f"shm client failed:\n{p.stderr[-3000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    # the same binary request from the aiohttp client: HTTP without tritonclient's cost
    res["aiohttp"] = drive(server.url, "kserve-binary-1mib", 1, seconds / 2, 0.5,
                           server.proc.pid)
    return res


def render_shm(res: dict) -> str:
    s, h, a = res["shm"], res["http"], res["aiohttp"]
    return "\n".join([
        "| 1 MiB in, 1 MiB out (x + 1), one client | p50 ms | p99 ms | HTTP binary p50 / this |",
        "|---|---|---|---|",
        f"| tritonclient.http, system shared memory | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | "
        f"{h['p50_ms'] / s['p50_ms']:.2f}x |",
        f"| tritonclient.http, binary tensors | {h['p50_ms']:.2f} | {h['p99_ms']:.2f} | 1.00x |",
        f"| aiohttp client, binary tensors | {a['p50_ms']:.2f} | {a['p99_ms']:.2f} | "
        f"{h['p50_ms'] / a['p50_ms']:.2f}x |",
    ])


# -- section 3: the HTTP library ----------------------------------------------------------------

def minimal_main(library: str, repo: str, port: int) -> None:
    """A minimal KServe v2 infer endpoint (JSON or binary tensors) on the models of
    ``repo``, loaded exactly as neuronmp-serve loads them, in aiohttp or starlette."""
    import neuronmp
    from neuronmp.server.models import load_models
    from neuronmp.server.shm import Registry

    models = load_models(repo)
    registry = Registry()

    null_json = json.dumps({"model_name": "null", "model_version": "1", "outputs": [
        {"name": "OUTPUT__0", "datatype": "FP32", "shape": [1, 10], "data": [0.5] * 10}]}).encode()

    async def infer(name: str, body: bytes, header_len: Optional[str]):
        if header_len is None:
            header, binary = body, memoryview(b"")
        else:
            n = int(header_len)
            header, binary = body[:n], memoryview(body)[n:]
        req = json.loads(header)
        if name == "null":     # HTTP only: no model; the input comes back as it is
            if header_len is None:
                return null_json, {"Content-Type": "application/json"}
            head = json.dumps({"model_name": "null", "model_version": "1", "outputs": [
                {"name": "OUTPUT__0", "datatype": "FP32", "shape": [1, len(binary) // 4],
                 "parameters": {"binary_data_size": len(binary)}}]}).encode()
            return b"".join([head, binary]), {HEADER_LEN: str(len(head)),
                                              "Content-Type": "application/octet-stream"}
        served = models[name]
        inputs = served.decode(req, binary, registry)
        result = await served.server.infer_async(*inputs)
        binary_out = any((o.get("parameters") or {}).get("binary_data")
                         for o in req.get("outputs") or [])
        docs, blobs = [], []
        for out in served.outputs(result):
            t = out.tensor.contiguous()
            doc = {"name": out.name, "datatype": "FP32", "shape": list(t.shape)}
            if binary_out:
                raw = t.numpy().tobytes()
                doc["parameters"] = {"binary_data_size": len(raw)}
                blobs.append(raw)
            else:
                doc["data"] = t.flatten().tolist()
            docs.append(doc)
        head = json.dumps({"model_name": name, "model_version": "1",
                           "outputs": docs}).encode()
        if not blobs:
            return head, {"Content-Type": "application/json"}
        return b"".join([head, *blobs]), {HEADER_LEN: str(len(head)),
                                          "Content-Type": "application/octet-stream"}

    try:
        if library.startswith("aiohttp"):
            from aiohttp import web

            if library == "aiohttp-uvloop":
                import uvloop
                uvloop.install()

            async def a_infer(request):
                body, headers = await infer(request.match_info["model"], await request.read(),
                                            request.headers.get(HEADER_LEN))
                return web.Response(body=body, headers=headers)

            async def a_ready(request):
                return web.Response()

            app = web.Application(client_max_size=1 << 30)
            app.router.add_post("/v2/models/{model}/infer", a_infer)
            app.router.add_get("/v2/health/ready", a_ready)
            web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
        else:
            import uvicorn
            from starlette.applications import Starlette
            from starlette.responses import Response
            from starlette.routing import Route

            async def s_infer(request):
                body, headers = await infer(request.path_params["model"], await request.body(),
                                            request.headers.get(HEADER_LEN))
                return Response(body, headers=headers)

            async def s_ready(request):
                return Response()

            app = Starlette(routes=[Route("/v2/models/{model}/infer", s_infer, methods=["POST"]),
                                    Route("/v2/health/ready", s_ready)])
            uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning",
                        access_log=False)
    finally:
        for m in models.values():
            m.close()
        neuronmp.shutdown()


LIBRARIES = {"aiohttp": "minimal handler, aiohttp",
             "starlette": "minimal handler, starlette + uvicorn",
             "aiohttp-uvloop": "minimal handler, aiohttp on uvloop"}


def run_library(repos: dict, seconds: float, warm: float, concurrency: int,
                shm_seconds: float, rounds: int, libraries: Sequence[str]) -> tuple:
    """Each server in turn, ``rounds`` times over; the shared-memory client runs against
    neuronmp-serve in the first round."""
    rows, shm_res = [], None
    servers = [("neuronmp-serve (as built)", lambda: start_neuronmp(repos["lib"]))] + [
        (LIBRARIES[lib], lambda lib=lib: start_minimal(repos["lib"], lib)) for lib in libraries]
    for rnd, (label, start) in ((rnd, s) for rnd in range(rounds) for s in servers):
        try:
            server = start()
        except RuntimeError as exc:
            print(f"skipped {label}: {str(exc).splitlines()[0]}", file=sys.stderr)
            continue
        try:
            check_answer(server, "kserve-json", lambda x: expected_mlp(repos["weights"], x))
            check_answer(server, "kserve-binary-1mib", lambda x: x + 1)
            loads = [(label, "kserve-json"), (label, "kserve-binary-1mib")] if seconds else []
            if seconds and label.startswith("minimal"):    # the same process, HTTP alone
                floor = label.replace("minimal handler", "HTTP only (no model)")
                loads += [(floor, "null-json"), (floor, "null-binary-1mib")]
            for row_label, cname in loads:
                r = drive(server.url, cname, concurrency, seconds, warm, server.proc.pid)
                r.update(server=row_label, codec=cname.replace("null", "kserve"),
                         clients=concurrency, round=rnd,
                         per_cpu=r["requests"] / max(r["front_cpu_s"], 1e-9))
                rows.append(r)
                print(f"  {row_label:42} {cname:18}: {r['rps']:6.0f} req/s, "
                      f"{r['per_cpu']:6.0f} req per CPU-s", file=sys.stderr, flush=True)
            if shm_seconds and shm_res is None and label.startswith("neuronmp-serve"):
                shm_res = run_shm(server, shm_seconds)
        finally:
            server.stop()
    return median_rows(rows), shm_res


def render_library(rows: List[dict], concurrency: int, seconds: float) -> str:
    lines = [f"{concurrency} clients, {seconds:g} s per row (medians over the rounds); CPU = "
             "user + system seconds of the HTTP process (psutil cpu_times; the core workers "
             "are the same for all rows)",
             "", "| server | request | req/s | HTTP process CPU (of 1) | req per CPU-second | "
             "/ neuronmp-serve |", "|---|---|---|---|---|---|"]
    base = {r["codec"]: r for r in rows if r["server"].startswith("neuronmp-serve")}
    what = {"kserve-json": "small JSON (512 in, 10 out)",
            "kserve-binary-1mib": "1 MiB binary in and out"}
    for cname in ("kserve-json", "kserve-binary-1mib"):
        for r in rows:
            if r["codec"] != cname:
                continue
            b = base.get(cname)
            ratio = r["per_cpu"] / b["per_cpu"] if b else float("nan")
            lines.append(f"| {r['server']} | {what[cname]} | {r['rps']:.0f} | "
                         f"{r['front_cpu_s'] / seconds:.2f} | {r['per_cpu']:.0f} | {ratio:.2f} |")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=6.0, help="measured seconds per point")
    p.add_argument("--warm", type=float, default=1.0, help="unmeasured seconds before each")
    p.add_argument("--rounds", type=int, default=1,
                   help="start every server this many times, in turn; the tables show medians")
    p.add_argument("--delay-ms", type=float, default=2.0,
                   help="max_queue_delay / batch timeout of every server")
    p.add_argument("--peers", default="litserve,mosec,ray",
                   help="comma list of litserve, mosec, ray (skipped if not installed)")
    p.add_argument("--clients", type=int, nargs="*", default=list(CLIENTS))
    p.add_argument("--sections", default="throughput,shm,library")
    p.add_argument("--library-clients", type=int, default=16)
    p.add_argument("--libraries", default="aiohttp,starlette",
                   help="minimal servers to compare: aiohttp, starlette, aiohttp-uvloop")
    p.add_argument("--json", action="store_true", help="also print the raw results")
    p.add_argument("--plot", metavar="PATH", help="also draw the throughput section (req/s, "
                   "p99 by clients) as a PNG (matplotlib), its figures in PATH.json")
    p.add_argument("--client-procs", default="auto",
                   help="load-client processes per point: a number, or auto (one per "
                        f"{CLIENTS_PER_PROC} connections)")
    p.add_argument("--buckets", default="1,2,4,8,16,24,32",
                   help="batch buckets of neuronmp-serve's MLP (comma list), or none: "
                        "every batch padded to 32 rows")
    p.add_argument("--compare-aiohttp", action="store_true",
                   help="also serve the MLP with --http-frontend aiohttp (neuronmp-aiohttp), "
                        "in the same run")
    p.add_argument("--compare-buckets", metavar="LIST",
                   help="also serve the MLP traced with these batch buckets (neuronmp-alt), "
                        "in the same run")
    p.add_argument("--compare-optlevel3", action="store_true",
                   help="also serve the MLP traced with compiler_args=\"--optlevel 3\" "
                        "(neuronmp-O3), in the same run")
    p.add_argument("--compare-padded", action="store_true",
                   help="also serve the MLP without buckets (neuronmp-padded), in the same run")
    p.add_argument("--formats", default="kserve-binary,kserve-json",
                   help="neuronmp-serve's wire formats to load it with")
    # internal: the processes this tool starts
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--shm-client", help=argparse.SUPPRESS)
    p.add_argument("--minimal", help=argparse.SUPPRESS)
    p.add_argument("--repo", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        client_main(json.loads(args.client))
        return 0
    if args.shm_client:
        shm_client_main(json.loads(args.shm_client))
        return 0
    if args.minimal:
        minimal_main(args.minimal, args.repo, args.port)
        return 0

    global _client_procs
    _client_procs = args.client_procs
    buckets = None if args.buckets == "none" else [int(b) for b in args.buckets.split(",")]
    from neuronmp.host import settings

    cores = settings.get("topology").num_cores   # the emulated host's cores (no runtime here)
    sections = set(args.sections.split(","))
    peers = [x for x in args.peers.split(",") if x]
    root = tempfile.mkdtemp(prefix="bench-http-")
    out = {}
    load_start = os.getloadavg()[0]
    try:
        print(f"tracing the models into {root} ...", file=sys.stderr, flush=True)
        alt = [int(b) for b in args.compare_buckets.split(",")] if args.compare_buckets \
            else None
        repos = make_repositories(root, cores, round(args.delay_ms * 1000), buckets,
                                  padded=args.compare_padded and buckets is not None, alt=alt,
                                  o3=args.compare_optlevel3)
        if "throughput" in sections:
            raw = run_throughput(repos, peers, cores, args.delay_ms, args.seconds,
                                 args.warm, args.clients, args.rounds,
                                 args.formats.split(","), args.compare_aiohttp)
            out["throughput_rounds"] = raw
            out["throughput"] = median_rows(raw)
        if sections & {"shm", "library"}:
            lib_rows, shm_res = run_library(
                repos, args.seconds if "library" in sections else 0, args.warm,
                args.library_clients, args.seconds if "shm" in sections else 0, args.rounds,
                args.libraries.split(","))
            out["library"], out["shm"] = lib_rows, shm_res
    finally:
        shutil.rmtree(root, ignore_errors=True)

    missed = []
    print(f"\nneuronmp-serve against other servers: bench_dp's MLP 512-1024-1024-10, "
          f"single-sample requests, {args.seconds:g} s per row (median of {args.rounds} "
          f"round(s)); load: client processes of asyncio + aiohttp ClientSessions, closed "
          f"loop, results merged; server CPU = user + system of the server's process tree, "
          f"split into its HTTP front end (neuronmp-serve's process, mosec's Rust binary) "
          f"and its model workers (neuronmp's core workers, the peers' Python workers); "
          f"load average (1 min) {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} "
          f"at the end")
    if out.get("throughput"):
        print(render_throughput(out["throughput"], cores, args.delay_ms, args.clients,
                                buckets, alt))
        checks = check_targets(out["throughput"], args.clients)
        if checks:
            print("\nthe serving targets:")
        for what, held in checks:
            print(f"  {'held' if held else 'MISSED'}: {what}")
        missed += [what for what, held in checks if not held]
    if out.get("shm"):
        print("\nshared memory against HTTP (tritonclient.http in a client process):")
        print(render_shm(out["shm"]))
        ratio = out["shm"]["http"]["p50_ms"] / out["shm"]["shm"]["p50_ms"]
        if ratio < 3:
            missed.append(f"shared memory only {ratio:.2f}x faster than binary HTTP (p50); "
                          "target 3x")
    if out.get("library") and "library" in sections:
        print("\nHTTP library:")
        print(render_library(out["library"], args.library_clients, args.seconds))
    if args.json:
        print(json.dumps(out, indent=2))
    if args.plot and out.get("throughput"):
        import plotting

        plotting.save(plotting.serving_figure(out["throughput"], FORMATS, sys.argv[1:]),
                      args.plot)
    for m in missed:
        print(f"target missed: {m}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
