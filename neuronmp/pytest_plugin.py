"""pytest plugin: an emulated Neuron host per test, for testing core-partitioning code.

Registered as the ``pytest11`` entry point ``neuronmp.pytest_plugin``, so
``pip install neuronmp`` is enough (``-p neuronmp.pytest_plugin`` loads it by hand).
It is inert until a test asks for ``neuron_host``: no autouse fixture, nothing
imported beyond neuronmp's torch-free layers.

    --neuron-topology NAME   (ini neuron_topology)  host of neuron_host (default 4x4)
    --neuron-provide LIST    (ini neuron_provide)   exported as NEURONMP_PROVIDE, and the
                                                    aliases importable in pytest's process
    @pytest.mark.neuron_topology("inf2.48xlarge", lnc=None)   per test, wins

    neuron_host  (per test)
      private runtime dir (0700, on /dev/shm) ---.
      topology, NEURON_LOGICAL_NC_CONFIG --------+--> test env (monkeypatched) and
      NEURON_RT_* / rank variables cleared ------'    every child's env
      .run(code | script, env={...}) --> fresh python --> RunResult (rc, out, err, .json)
      .start(...) --> Popen (a holder kept alive); .wait(proc) --> RunResult
      teardown: stop started processes, shut an in-test runtime down, then fail
                the test on any process still carrying the runtime dir, a held
                core lock, or a shared-memory segment left in <dir>/shm
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
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Union

import pytest

from .host import leftovers
from .host import topology as _topology

ENV_PROVIDE = "NEURONMP_PROVIDE"
PROVIDE_ACCEPTED = ("torch_neuronx", "torch_neuron", "torchneuron")   # neuronmp/provide's
DEFAULT_TOPOLOGY = "4x4"
DEFAULT_TIMEOUT = 120.0

#: what a child must not inherit from the test's own environment
_CLEARED = (
    "NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES", _topology.ENV_LNC,
    "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE",
)


# -- options, marker, NEURONMP_PROVIDE ------------------------------------------------


def pytest_addoption(parser) -> None:
    group = parser.getgroup("neuronmp", "emulated Neuron host (neuronmp)")
    group.addoption("--neuron-topology", default=None, metavar="NAME",
                    help="host of the neuron_host fixture: an instance type such as "
                    f"trn2.48xlarge, or CHIPSxCORES (default: ini neuron_topology, "
                    f"else {DEFAULT_TOPOLOGY})")
    group.addoption("--neuron-provide", default=None, metavar="MODULES",
                    help="comma list of Neuron packages neuronmp stands in for "
                    f"({', '.join(PROVIDE_ACCEPTED)}); exported as {ENV_PROVIDE}")
    parser.addini("neuron_topology", "default host of the neuron_host fixture", default="")
    parser.addini("neuron_provide", f"default of --neuron-provide ({ENV_PROVIDE})", default="")


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "neuron_topology(name, lnc=None): the emulated host of neuron_host for "
        "this test (an instance type or CHIPSxCORES; lnc: NEURON_LOGICAL_NC_CONFIG)")
    name = _configured_topology(config)
    try:
        _topology.parse(name, cpus=[0])
    except ValueError as exc:
        raise pytest.UsageError(f"--neuron-topology: {exc}") from None
    config._neuronmp_topology = name
    provide = _setting(config, "neuron_provide")
    config._neuronmp_saved_provide = os.environ.get(ENV_PROVIDE)
    if provide:
        os.environ[ENV_PROVIDE] = check_provide(provide)
        _install_aliases()   # this process too, not only the children that read it at start


def pytest_unconfigure(config) -> None:
    if not _setting(config, "neuron_provide"):
        return
    saved = getattr(config, "_neuronmp_saved_provide", None)
    if saved is None:
        os.environ.pop(ENV_PROVIDE, None)
    else:
        os.environ[ENV_PROVIDE] = saved
    _install_aliases()


def _install_aliases() -> None:
    """The alias finder for the current NEURONMP_PROVIDE (imported only when asked for)."""
    from . import provide

    provide.install()


def _configured_topology(config) -> str:
    return (_setting(config, "neuron_topology") or DEFAULT_TOPOLOGY).strip()


def _setting(config, name: str) -> str:
    # command line first, then ini; a plugin loaded late (pytest_plugins in a test
    # module) may find neither registered
    value = config.getoption(name, default=None)
    if value:
        return value
    try:
        return config.getini(name)
    except ValueError:
        return ""


def check_provide(value: str) -> str:
    """A --neuron-provide value, normalised (``torch_neuronx,torch_neuron``), or UsageError."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in PROVIDE_ACCEPTED]
    if bad or not names:
        raise pytest.UsageError(
            f"Invalid --neuron-provide {value!r}: expected a comma list of "
            f"{', '.join(PROVIDE_ACCEPTED)}")
    return ",".join(dict.fromkeys(names))


# -- results --------------------------------------------------------------------------


@dataclass(frozen=True)
class RunResult:
    """What a child process did: its exit status and output (text)."""

    args: List[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def json(self):
        """The JSON document on the last non-empty line of stdout."""
        lines = [line for line in self.stdout.splitlines() if line.strip()]
        try:
            return json.loads(lines[-1])
        except (IndexError, ValueError):
            raise AssertionError(
                f"the child printed no JSON on its last line (exit {self.returncode})\n"
                f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}") from None


# -- the host ---------------------------------------------------------------------------


class NeuronHost:
    """One test's emulated Neuron host; see the module docstring."""

    def __init__(self, name: str, lnc: Optional[str], runtime_dir: str, tmp_path: Path):
        self.topology = _topology.parse(name, lnc=lnc)
        self.lnc = lnc
        self.runtime_dir = runtime_dir
        self._tmp_path = tmp_path
        self._started: List[subprocess.Popen] = []
        self._stderr: Dict[int, str] = {}
        self._count = 0

    @property
    def name(self) -> str:
        return self.topology.name

    def environ(self, env: Optional[Mapping[str, Optional[str]]] = None) -> Dict[str, str]:
        """A child's environment: the test's, with ``env`` on top (None unsets a name)."""
        full = dict(os.environ)
        for key, value in (env or {}).items():
            if value is None:
                full.pop(key, None)
            elif not isinstance(value, str):
                raise TypeError(f"env[{key!r}] must be a str or None, got {value!r}")
            else:
                full[key] = value
        return full

    def start(self, code_or_script: Union[str, os.PathLike], env=None,
              args: Sequence[str] = (), cwd=None) -> subprocess.Popen:
        """Start a fresh Python process on this host and return it at once.

        Its stdin and stdout are text pipes (to hand it work, to read a "ready" line);
        its stderr goes to a file that ``wait`` returns.  Stopped at teardown if still
        running.
        """
        return self._spawn(code_or_script, env, args, cwd, subprocess.PIPE, subprocess.PIPE)

    def wait(self, proc: subprocess.Popen, timeout: float = DEFAULT_TIMEOUT) -> RunResult:
        """Close a started process's stdin, let it finish, and collect what it did."""
        if proc.stdin is not None:
            if not proc.stdin.closed:
                proc.stdin.close()
            proc.stdin = None  # communicate() would flush it, closed by the caller or not
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._overdue(proc, timeout)
        return RunResult(list(proc.args), proc.returncode, out or "", self._stderr_of(proc))

    def run(self, code_or_script: Union[str, os.PathLike], env=None, args: Sequence[str] = (),
            timeout: float = DEFAULT_TIMEOUT, cwd=None) -> RunResult:
        """Run code (a string) or a script (a path) in a fresh Python process on this host.

        ``env`` adds variables (such as ``{"NEURON_RT_VISIBLE_CORES": "0-1"}``) to the
        host's environment.  A string naming an existing file is run as a script.
        Output goes through files, so a descendant the code leaves behind cannot
        stall the call (it fails the test at teardown instead).
        """
        out_path = self._output_path("out")
        with open(out_path, "w") as out:
            proc = self._spawn(code_or_script, env, args, cwd, subprocess.DEVNULL, out)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._overdue(proc, timeout)
        with open(out_path) as f:
            stdout = f.read()
        return RunResult(list(proc.args), proc.returncode, stdout, self._stderr_of(proc))

    def _spawn(self, code_or_script, env, args, cwd, stdin, stdout) -> subprocess.Popen:
        argv = [sys.executable, *_target(code_or_script), *map(str, args)]
        err_path = self._output_path("err")
        with open(err_path, "w") as err:
            proc = subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=err,
                                    text=True, env=self.environ(env), cwd=cwd)
        self._started.append(proc)
        self._stderr[proc.pid] = err_path
        return proc

    def _output_path(self, kind: str) -> str:
        directory = self._tmp_path / "neuron_host"
        directory.mkdir(exist_ok=True)
        self._count += 1
        return str(directory / f"{self._count}.{kind}")

    def _stderr_of(self, proc: subprocess.Popen) -> str:
        with open(self._stderr[proc.pid]) as f:
            return f.read()

    def _overdue(self, proc: subprocess.Popen, timeout: float) -> None:
        leftovers.kill_tree(proc.pid)
        proc.wait(timeout=leftovers.GRACE)
        pytest.fail(f"{proc.args!r} did not finish within {timeout} s (killed)\n"
                    f"stderr:\n{self._stderr_of(proc)}", pytrace=False)

    def devices(self) -> List[dict]:
        """This host as ``neuron-ls --json-output`` shows it now (holders included)."""
        from .cli import ls

        return ls.neuron_ls_devices()

    def install_tools(self) -> str:
        """Put ``neuron-ls`` / ``neuron-top`` for this host first on the PATH; return their dir."""
        from .cli import ls

        directory = str(self._tmp_path / "neuron-bin")
        ls.install_tools(directory)
        os.environ["PATH"] = directory + os.pathsep + os.environ.get("PATH", "")
        return directory

    def __repr__(self) -> str:
        return f"<NeuronHost {self.name} lnc={self.topology.lnc} dir={self.runtime_dir}>"


def _target(code_or_script) -> List[str]:
    if isinstance(code_or_script, os.PathLike):
        return [os.fspath(code_or_script)]
    if not isinstance(code_or_script, str):
        raise TypeError(f"expected code (str) or a script path, got {code_or_script!r}")
    if "\n" not in code_or_script and os.path.isfile(code_or_script):
        return [code_or_script]
    return ["-c", code_or_script]


def _host_args(request):
    marker = request.node.get_closest_marker("neuron_topology")
    name = getattr(request.config, "_neuronmp_topology", None) or \
        _configured_topology(request.config)
    lnc = None
    if marker is not None:
        if len(marker.args) != 1 or set(marker.kwargs) - {"lnc"}:
            raise pytest.UsageError(
                f"Invalid neuron_topology marker on {request.node.nodeid}: expected "
                "neuron_topology(name) or neuron_topology(name, lnc=1|2)")
        name, lnc = marker.args[0], marker.kwargs.get("lnc")
    return name, None if lnc is None else str(lnc)


@pytest.fixture
def neuron_host(request, monkeypatch, tmp_path):
    """An emulated Neuron host private to this test (see NeuronHost)."""
    name, lnc = _host_args(request)
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    directory = tempfile.mkdtemp(prefix="neuronmp-host-", dir=base)
    try:
        host = NeuronHost(name, lnc, directory, tmp_path)
    except Exception:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    for key in _CLEARED:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(_topology.ENV_TOPOLOGY, name)
    monkeypatch.setenv("NEURONMP_RUNTIME_DIR", directory)
    if lnc is not None:
        monkeypatch.setenv(_topology.ENV_LNC, lnc)
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))  # install_tools() changes it
    had_runtime = _runtime_initialized()
    yield host
    problems = _teardown(host, had_runtime)
    shutil.rmtree(directory, ignore_errors=True)
    if problems:
        pytest.fail("neuron_host leaked: " + "; ".join(problems), pytrace=False)


# -- teardown and leak checks --------------------------------------------------------------


def _teardown(host: NeuronHost, had_runtime: bool) -> List[str]:
    for proc in host._started:
        _stop(proc)
    problems = []
    if not had_runtime and _runtime_initialized():
        problems += leftovers.shutdown_runtime()
    leaked = _tagged_processes(host.runtime_dir)
    problems += [f"process {p.pid} ({_cmdline(p)}) still running" for p in leaked]
    problems += leftovers.held_locks(host.runtime_dir) + leftovers.segments(host.runtime_dir)
    for p in leaked:
        leftovers.kill_tree(p.pid)
    return problems


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # a chance to shut down as on any host
        try:
            proc.wait(timeout=leftovers.GRACE)
        except subprocess.TimeoutExpired:
            leftovers.kill_tree(proc.pid)
            proc.wait(timeout=leftovers.GRACE)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream:
            stream.close()


def _runtime_initialized() -> bool:
    mod = sys.modules.get("neuronmp.host.runtime")
    check = getattr(mod, "is_initialized", None)
    return bool(check and check())


def _tagged_processes(runtime_dir: str) -> list:
    """Processes (not this one) whose environment names this host's runtime directory,
    after a grace period: everything started for the host carries it, including
    grandchildren that outlived their parent."""
    import psutil

    deadline = time.monotonic() + leftovers.GRACE
    while True:
        found = []
        for p in psutil.process_iter():
            if p.pid == os.getpid():
                continue
            try:
                if p.environ().get("NEURONMP_RUNTIME_DIR") == runtime_dir and \
                        p.status() != psutil.STATUS_ZOMBIE and not leftovers.is_helper(p):
                    found.append(p)
            except (psutil.Error, OSError):
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _cmdline(proc, width: Optional[int] = 80) -> str:
    try:
        return " ".join(proc.cmdline())[:width]
    except Exception:
        return "?"
