"""Fixtures shared by every test: isolation and leak checks.

Each test runs with
  * its own runtime directory on /dev/shm (locks, holder files, ring segments),
  * an emulated topology (``4x4`` unless the test asks for another with
    ``emulated``), and no inherited NEURON_RT_* / torchrun variables,
and afterwards it must have left behind no child process (the long-lived
multiprocessing forkserver excepted, though never its children), no held core
lock and no shared-memory segment.  A leak fails the test that caused it.

``procs.python(code)`` children that import torch start as forks of a warm
interpreter that imported it once (tests/warm_support.py says when, and when not);
``pytest --cold-python`` starts every one fresh.

Numbers: one model's float32 results at different batch sizes or thread counts differ
in their last bits (a few 1e-6 apart on x86: the matmul blocking changes), so tests
compare computed tensors with torch.testing.assert_close's defaults (rtol 1.3e-6,
atol 1e-5) or allclose with atol=1e-5, and exactly only where one computation is
repeated in the same process.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest
import warm_support  # tests/, on the path by setup.cfg's pythonpath

from neuronmp.host import leftovers, procid

_CLEARED = (
    "NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES", "NEURONMP_TOPOLOGY",
    "NEURONMP_RUNTIME_DIR", "NEURONMP_RESERVE_TIMEOUT", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS", "NEURON_LOGICAL_NC_CONFIG",
    "NEURONMP_DEVICE_TIME_US", "NEURONMP_WEIGHTS_DIR", "NEURONMP_SHARE_WEIGHTS",
    "NEURON_PROCESS_TAG",
)


_BASE = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
_TEST_DIR = "neuronmp-test-"


def pytest_addoption(parser):
    parser.addoption("--cold-python", action="store_true",
                     help="start every procs.python child as a fresh interpreter, "
                     "never as a fork of the warm one (tests/warm_support.py)")


_BASETEMP = "nmpt-"


def pytest_configure(config):
    warm_support.enabled = not config.getoption("--cold-python")
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        # A short base for tmp_path: a pool's forkserver socket lives under the test's
        # TMPDIR (tmp_path/tmp), and AF_UNIX paths stop at 107 bytes; pytest's default
        # base plus pytest-xdist's popen-gwN/ leaves too little room for it.  Named by
        # this process's pid and start time, so a killed run's base is swept below.
        me = procid.current()
        base = os.path.join(tempfile.gettempdir(), f"{_BASETEMP}{me.pid}-{me.start}")
        os.makedirs(base, 0o700, exist_ok=True)
        config.option.basetemp = base
        config.add_cleanup(lambda: shutil.rmtree(config.option.basetemp, ignore_errors=True))


def pytest_sessionfinish(session):
    warm_support.close()


def pytest_sessionstart(session):
    """Remove the runtime directories of test runs that were killed before their
    teardown (named by their process's pid and start time, so a reused pid is no
    excuse to keep or to delete one)."""
    for base, prefix in ((_BASE or tempfile.gettempdir(), _TEST_DIR),
                         (tempfile.gettempdir(), _BASETEMP)):
        for name in os.listdir(base):
            if not name.startswith(prefix):
                continue
            pid, start = (name[len(prefix):].split("-") + ["", ""])[:2]
            if pid.isdigit() and start.isdigit() and \
                    procid.of(int(pid)) != procid.ProcId(int(pid), int(start)):
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)


@pytest.fixture(autouse=True)
def runtime_dir(monkeypatch, tmp_path):
    """A private runtime directory for this test, on tmpfs like the default.

    Subprocesses also get their own TMPDIR under pytest's tmp_path, so what
    they leave there (a launcher's kept logs) goes with pytest's clean-up.
    """
    me = procid.current()
    path = tempfile.mkdtemp(prefix=f"{_TEST_DIR}{me.pid}-{me.start}-", dir=_BASE)
    os.chmod(path, 0o700)
    for name in _CLEARED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NEURONMP_RUNTIME_DIR", path)
    monkeypatch.setenv("NEURONMP_TOPOLOGY", "4x4")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    signals = _signal_state()
    yield path
    problems = leftovers.shutdown_runtime() + _stray_children()
    problems += leftovers.held_locks(path) + leftovers.segments(path)
    problems += _signals_changed(signals)
    shutil.rmtree(path, ignore_errors=True)
    if problems:
        pytest.fail("test leaked: " + "; ".join(problems), pytrace=False)


@pytest.fixture
def emulated(monkeypatch):
    """Switch the emulated topology: ``emulated("inf1.6xlarge")`` returns it."""
    from neuronmp.host import settings

    def use(spec: str):
        monkeypatch.setenv("NEURONMP_TOPOLOGY", spec)
        return settings.parse_field("topology")

    return use


class Procs:
    """Subprocesses of a test; every one is killed and reaped at teardown."""

    def __init__(self):
        self.started = []

    def python(self, code: str, env=None, **kwargs) -> subprocess.Popen:
        """Start ``python -c code`` with the test's environment plus ``env``; a script
        that imports torch starts as a fork of the session's warm interpreter when
        nothing it can see differs (tests/warm_support.py)."""
        full = dict(os.environ)
        full.update(env or {})
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("text", True)
        template = warm_support.template_for(full) \
            if warm_support.eligible(code, kwargs) else None
        if template is not None:
            proc = warm_support.WarmPopen(template, code, env=full, **kwargs)
            self.started.append(proc)
            return proc
        return self.popen([sys.executable, "-c", code], env=full, **kwargs)

    def popen(self, argv, **kwargs) -> subprocess.Popen:
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            # started under nohup or as a script's background job: a child would inherit
            # the ignored SIGINT, and the tests that send it one would wait forever
            kwargs.setdefault("preexec_fn", _default_sigint)
        proc = subprocess.Popen(argv, **kwargs)
        self.started.append(proc)
        return proc

    def close(self):
        for proc in self.started:
            if proc.poll() is None:
                leftovers.kill_tree(proc.pid)
            proc.wait(timeout=10)
            for stream in (proc.stdout, proc.stderr, proc.stdin):
                if stream:
                    stream.close()


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def procs():
    group = Procs()
    yield group
    group.close()


def _signal_state():
    if threading.current_thread() is not threading.main_thread():
        return None
    return (signal.pthread_sigmask(signal.SIG_BLOCK, []),
            {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)})


def _signals_changed(before):
    """A test must leave the main thread's signal mask and handlers as it found them:
    a blocked or ignored SIGINT is inherited by every process started afterwards."""
    after = _signal_state()
    if before is None or after == before:
        return []
    mask, handlers = before
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)
    return [f"signal state changed: mask {sorted(after[0])} (was {sorted(mask)}), "
            f"handlers {after[1]} (were {handlers})"]


#: Set in the environment of a process a module- or session-scoped fixture owns (a
#: server started once per module, or the one tests/server/conftest.py shares): its
#: tree is not a test's leak; the fixture stops it and checks what it leaves behind.
SHARED_MARK = "NEURONMP_TEST_SHARED_SERVER"


def _is_shared(proc: psutil.Process) -> bool:
    try:
        return any(p.environ().get(SHARED_MARK) for p in [proc] + proc.parents())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return False


def _stray_children():
    me = psutil.Process()
    deadline = time.monotonic() + leftovers.GRACE
    while True:
        stray = []
        for p in me.children(recursive=True):
            try:
                if p.status() == psutil.STATUS_ZOMBIE and p.ppid() == me.pid:
                    os.waitpid(p.pid, os.WNOHANG)
                    continue
            except (psutil.NoSuchProcess, ChildProcessError):
                continue
            if p.pid in warm_support.template_pids():
                continue   # a warm interpreter of the session: its children are checked
            if not leftovers.is_helper(p) and not _is_shared(p):
                stray.append(p)
        if not stray or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    out = []
    for p in stray:
        try:
            out.append(f"child process {p.pid} ({' '.join(p.cmdline())[:80]}) still running")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return out
