"""A warm interpreter for the tests' ``python -c`` children that import torch.

Most of such a child's start is ``import torch``.  A *template* process imports it
once per import-time environment (:func:`template_for`: at most
:data:`MAX_TEMPLATES` per session); each eligible ``procs.python(code)`` or
torchneuron_support script is then a fork of a template that takes the test's
environment, working directory, standard streams and ``-c`` arguments, and runs
``code`` as ``__main__``, exiting as an interpreter does (atexit, finalisation):

    pytest ──Popen──▶ template (python -c _TEMPLATE: import torch, then wait)
      │  request: code, argv, env, cwd      │ fork
      │  + fds stdin/stdout/stderr, status ─┤──▶ child: dup2 its streams, env, cwd,
      │                                     │           SIGINT default, run code
      ◀── pid ──────────────────────────────┘    exit ─▶ template reaps it (pidfd)
      WarmPopen.wait() ◀── wait status on the status pipe ──┘

The child is a grandchild of pytest, so the root conftest's leak check still
sees it (the templates themselves are exempt: :func:`template_pids`).  A script
runs warm only when nothing it can observe differs from a fresh interpreter's
start: it imports torch itself (so torch in ``sys.modules`` is no news to it) and
does not inspect ``sys.modules`` (:func:`eligible`); its template imported torch
with the same values of every variable read meanwhile (OpenMP, MKL, torch's own,
the loader's, Python's, and with NEURONMP_PROVIDE the neuron device's topology
and cores); that import printed nothing; and it keeps the session's extension
cache and compiler.  Everything else starts a fresh interpreter, as before.
What differs still: the child's parent is the template, and /proc shows the
template's command line and start-up environment.
"""
from __future__ import annotations

import os
import pickle
import re
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from typing import Dict, List, Optional

from neuronmp.host import procid

#: environment prefixes read while torch (and the libraries it loads) import: a child
#: whose values differ from the template's needs a fresh interpreter
_IMPORT_TIME = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS", "TORCH", "PYTORCH", "LD_",
                "PYTHON", "MALLOC", "NEURONMP_PROVIDE", "CUDA", "ATEN", "DNNL", "ONEDNN")
#: read while the neuron device registers at ``import torch`` (NEURONMP_PROVIDE set)
_DEVICE = ("NEURON",)
#: where the neuron device's extension is found or built at import (NEURONMP_PROVIDE):
#: a child that changes them gets a fresh interpreter, so only it builds there
_BUILDS = ("NEURONMP_TORCHNEURON_CACHE", "XDG_CACHE_HOME", "HOME", "CXX", "CC")
#: a test's own, never read at import: not part of a template's key
_PER_TEST = ("NEURONMP_RUNTIME_DIR",)
_IMPORTS_TORCH = re.compile(r"^[ \t]*(?:import[^\n#]*\btorch\b|from torch\b)", re.M)
_STATUS = struct.Struct("i")
#: the Popen arguments a warm child honours (anything else: a fresh interpreter)
_STREAM_ARGS = {"stdin", "stdout", "stderr", "text", "cwd", "encoding", "errors",
                "universal_newlines", "bufsize"}

_TEMPLATE = r"""
import array, os, pickle, select, signal, socket, struct, sys
sock = socket.socket(fileno=int(sys.argv[1]))
signal.signal(signal.SIGINT, signal.SIG_IGN)   # a terminal's Ctrl-C is for the children
import tempfile
said = tempfile.TemporaryFile()
os.dup2(said.fileno(), 1)
os.dup2(said.fileno(), 2)
import torch
sys.stdout.flush()
sys.stderr.flush()
silent = os.fstat(said.fileno()).st_size == 0
said.close()
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 1)
os.dup2(null, 2)
os.close(null)
sock.send(b"ready" if silent else b"noisy")
if not silent:
    sys.exit(0)
kids = {}   # pidfd -> (pid, status fd)

def serve():
    while True:
        ready, _, _ = select.select([sock, *kids], [], [])
        for fd in ready:
            if fd is not sock:
                pid, status = kids.pop(fd)
                os.close(fd)
                _, sts = os.waitpid(pid, 0)
                os.write(status, struct.pack("i", sts))
                os.close(status)
                continue
            try:
                msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
            except OSError:
                msg = b""
            if not msg:
                return None
            pid = os.fork()
            if pid == 0:
                return pickle.loads(msg), fds
            kids[os.pidfd_open(pid)] = (pid, fds[3])
            for fd in fds[:3]:
                os.close(fd)
            sock.send(struct.pack("i", pid))

job = serve()
if job is None:
    sys.exit(0)
(code, args, env, cwd), fds = job
for i in range(3):
    os.dup2(fds[i], i)
for fd in fds:
    os.close(fd)
for fd in kids:
    os.close(fd)
for _, status in kids.values():
    os.close(status)
sock.close()
del kids, job, fds
signal.signal(signal.SIGINT, signal.default_int_handler)
os.environ.clear()
os.environ.update(env)
if cwd is not None:
    os.chdir(cwd)
import tempfile
tempfile.tempdir = None
if "numpy.random" in sys.modules:
    sys.modules["numpy.random"].seed()
import builtins, types
main = types.ModuleType("__main__")
main.__builtins__ = builtins
sys.modules["__main__"] = main
sys.argv = ["-c", *args]
del array, pickle, select, signal, socket, struct, tempfile, builtins, types, serve
exec(compile(code, "<string>", "exec"), main.__dict__)
"""


class Template:
    """A template process (torch imported with ``env``) and the socket its fork
    requests go through; ``ok`` is false when its start said anything (a warning,
    a build message): a fresh interpreter would say it again, a fork would not."""

    def __init__(self, env: Dict[str, str]):
        # its own runtime directory: what the import may leave there is not a test's.
        # Named as the tests' are (the root conftest's), by this process's pid and
        # start time, so the next session sweeps it if this one is killed.
        me = procid.current()
        self.runtime_dir = tempfile.mkdtemp(prefix=f"neuronmp-test-{me.pid}-{me.start}-warm-",
                                            dir=_shm_or_tmp())
        self.env = {**env, "NEURONMP_RUNTIME_DIR": self.runtime_dir}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _TEMPLATE, str(theirs.fileno())], env=self.env,
            pass_fds=[theirs.fileno()], cwd="/", stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self.sock.settimeout(300)
        self.ok = self.sock.recv(16) == b"ready"

    def fork(self, code: str, args, env, cwd, fds) -> int:
        msg = pickle.dumps((code, list(args), dict(env), cwd))
        with self.lock:
            socket.send_fds(self.sock, [msg], list(fds))
            return _STATUS.unpack(self.sock.recv(16))[0]

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


def _shm_or_tmp() -> Optional[str]:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


class WarmPopen(subprocess.Popen):
    """``Popen([python, -c, code, *args])`` served by a fork of the template: the same
    pid, streams, signals and exit status as a fresh interpreter's."""

    def __init__(self, template: Template, code: str, args=(), **kwargs):
        self._template, self._code, self._args = template, code, tuple(args)
        self._status_fd = -1
        super().__init__([sys.executable, "-c", code, *args], **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                       startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                       c2pwrite, errread, errwrite, *rest):
        status_r, status_w = os.pipe()
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
               errwrite if errwrite != -1 else 2, status_w]
        try:
            self.pid = self._template.fork(self._code, self._args,
                                           os.environ if env is None else env,
                                           os.getcwd() if cwd is None else os.fspath(cwd),
                                           fds)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        self._status_fd = status_r
        self._child_created = True
        # as Popen does once its child has them: the child's ends are not ours to hold
        devnull = getattr(self, "_devnull", None)
        for child_end, parent_end in ((p2cread, p2cwrite), (c2pwrite, c2pread),
                                      (errwrite, errread)):
            if child_end != -1 and parent_end != -1 and child_end != devnull:
                os.close(child_end)
        if devnull is not None:
            os.close(devnull)
        self._closed_child_pipe_fds = True

    def _status(self, flags: int):
        fd = self._status_fd
        if fd < 0:
            raise ChildProcessError(self.pid)
        if flags & os.WNOHANG and not select.select([fd], [], [], 0)[0]:
            return 0, 0
        data = b""
        while len(data) < _STATUS.size:
            chunk = os.read(fd, _STATUS.size - len(data))
            if not chunk:
                break
            data += chunk
        os.close(fd)
        self._status_fd = -1
        if len(data) < _STATUS.size:   # the template is gone: no status to give
            raise ChildProcessError(self.pid)
        return self.pid, _STATUS.unpack(data)[0]

    def _try_wait(self, wait_flags):
        try:
            return self._status(wait_flags)
        except ChildProcessError:
            return self.pid, 0

    def _internal_poll(self, _deadstate=None, **_ignored):
        return super()._internal_poll(_deadstate, _waitpid=lambda _pid, flags:
                                      self._status(flags))


#: the environment the suite started with (this module is imported by the root
#: conftest, before any test sets its own): the templates' but for what their import reads
SESSION_ENV = dict(os.environ)
#: off with pytest --cold-python (the root conftest)
enabled = True
#: templates are kept per import-time environment, this many at most
MAX_TEMPLATES = 4
_templates: Dict[tuple, Template] = {}
_templates_lock = threading.Lock()


def eligible(code: str, kwargs: dict) -> bool:
    """Whether ``python -c code`` started with ``kwargs`` may run as a fork of a
    template (:func:`template_for` then picks one by the child's environment)."""
    if not enabled or set(kwargs) - _STREAM_ARGS:
        return False
    return "sys.modules" not in code and bool(_IMPORTS_TORCH.search(code))


def _import_time(env: Dict[str, str]) -> tuple:
    """The variables of ``env`` that ``import torch`` may read: with NEURONMP_PROVIDE
    the neuron device registers then, reading the topology and visible cores too."""
    prefixes = _IMPORT_TIME + (_DEVICE if env.get("NEURONMP_PROVIDE") else ())
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(prefixes) and k not in _PER_TEST))


def template_for(env: Dict[str, str]) -> Optional[Template]:
    """A template whose import saw what a fresh interpreter with ``env`` would see
    (started on first use from :data:`SESSION_ENV` and those variables), or None."""
    if any(env.get(k) != SESSION_ENV.get(k) for k in _BUILDS):
        return None   # the template's import would build into the child's cache for it
    key = _import_time(env)
    with _templates_lock:
        found = _templates.get(key)
        if found is None:
            if len(_templates) >= MAX_TEMPLATES:
                return None
            prefixes = _IMPORT_TIME + _DEVICE
            base = {k: v for k, v in SESSION_ENV.items() if not k.startswith(prefixes)}
            found = _templates[key] = Template({**base, **dict(key)})
        return found if found.ok else None


def template_pids() -> List[int]:
    return [t.proc.pid for t in _templates.values()]


def run(code: str, env: Dict[str, str], cwd=None,
        timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """``subprocess.run([python, -c, code], capture_output=True, text=True)``, warm
    when it may be (:func:`eligible`, :func:`template_for`)."""
    argv = [sys.executable, "-c", code]
    found = template_for(env) if eligible(code, {}) else None
    if found is None:
        return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)
    with WarmPopen(found, code, env=env, cwd=cwd, stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def close() -> None:
    with _templates_lock:
        while _templates:
            _templates.popitem()[1].close()
