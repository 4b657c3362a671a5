"""The single-host engine behind neuronmp-run: slice cores, start ranks, watch, stop.

An entry point.  The command line lives in ``neuronmp.cli.run``; this
module owns the rank processes of one job:

    plan_slices(job cores, N, K) -> N contiguous slices of K cores (or refusal)
        |
    run(LaunchConfig)
        |  attempt n:  spawn N ranks  (own process group, PR_SET_PDEATHSIG=SIGKILL,
        |              env: NEURON_RT_VISIBLE_CORES=<slice>, RANK, LOCAL_RANK, ...)
        |     watch:   wake on SIGCHLD / launcher signals (self-pipe), poll exits
        |     failure: stop the rest in stages: signal -> shared deadline -> SIGKILL
        |              restarts left? attempt n+1 : summary from the error files
        v
    exit code: 0 ok, 1 a rank failed, 128+sig when the launcher was signalled

Log tree: ``<log_dir>/<run_id>/attempt_<n>/<local_rank>/{stdout.log,stderr.log,
error.json}`` (torchrun's).  Imports no torch.
"""
from __future__ import annotations

import ctypes
import datetime
import errno
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import ConfigError
from ..host import visibility
from ..host.spans import span
from ..host.supervise import describe_exit, signal_name, stop_in_stages
from . import errorfile

#: stream codes of --redirects / --tee, as torchrun numbers them
NONE, STDOUT, STDERR, BOTH = 0, 1, 2, 3
STD_STREAMS_ACCEPTED = "0 (none), 1 (stdout), 2 (stderr), 3 (both), or per rank '0:1,1:2'"

ROOT_COMM_PORT = 62182  # torch-neuronx's default port for NEURON_RT_ROOT_COMM_ID

_PR_SET_PDEATHSIG = 1
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


# -- planning: which cores each rank gets -----------------------------------------


def plan_slices(cores: Sequence[int], nproc: Optional[int], per_proc: Optional[int],
                source: str = "") -> List[Tuple[int, ...]]:
    """Cut the job's cores into one contiguous slice per rank.

    ``nproc`` None means auto (as many ranks as fit); ``per_proc`` None means
    the cores divided evenly among ``nproc`` ranks.  Refuses, with the
    arithmetic, slices that do not divide evenly and more ranks than cores.
    """
    cores = tuple(cores)
    have = f"{len(cores)} core(s) ({span(cores, none='')}{', ' + source if source else ''})"
    if not cores:
        raise ConfigError("--cores", source, "the job has no cores", "at least one core")
    if per_proc is not None and per_proc < 1:
        raise ConfigError("--cores-per-proc", str(per_proc), "it must be at least 1",
                          "a whole number of cores per process, 1 or more")
    if nproc is not None and nproc < 1:
        raise ConfigError("--nproc-per-node", str(nproc), "it must be at least 1",
                          "a whole number of processes, 1 or more, or 'auto'")
    if nproc is None:
        per = per_proc or 1
        if per > len(cores) or len(cores) % per:
            raise ConfigError(
                "--cores-per-proc", str(per),
                f"the job has {have}, which does not divide into slices of {per} "
                f"({len(cores)} = {len(cores) // per} x {per} + {len(cores) % per})",
                f"a divisor of {len(cores)} for --nproc-per-node auto",
            )
        nproc = len(cores) // per
    elif per_proc is None:
        if nproc > len(cores):
            raise ConfigError(
                "--nproc-per-node", str(nproc),
                f"{nproc} processes need at least one core each but the job has {have}",
                f"at most {len(cores)} processes",
            )
        if len(cores) % nproc:
            raise ConfigError(
                "--nproc-per-node", str(nproc),
                f"the job's {have} do not divide evenly among {nproc} processes "
                f"({len(cores)} = {nproc} x {len(cores) // nproc} + {len(cores) % nproc})",
                f"a divisor of {len(cores)}, or --cores-per-proc to use fewer cores",
            )
        per = len(cores) // nproc
    else:
        per = per_proc
        if nproc * per > len(cores):
            raise ConfigError(
                "--nproc-per-node", str(nproc),
                f"{nproc} processes x {per} cores = {nproc * per} cores, "
                f"but the job has {have}",
                f"--nproc-per-node x --cores-per-proc <= {len(cores)}",
            )
    return [cores[i * per:(i + 1) * per] for i in range(nproc)]


def parse_std_streams(value: str, option: str = "--redirects") -> Dict[Optional[int], int]:
    """Parse ``3`` or ``0:1,1:2`` into {local_rank or None (every rank): code}."""
    text = str(value).strip()
    if text.isdigit() and int(text) <= BOTH:
        return {None: int(text)}
    out: Dict[Optional[int], int] = {}
    for entry in text.split(","):
        rank, sep, code = entry.partition(":")
        rank, code = rank.strip(), code.strip()
        if not (sep and rank.isdigit() and code.isdigit() and int(code) <= BOTH):
            raise ConfigError(option, value, f"{entry.strip()!r} is not a stream code or "
                              "LOCAL_RANK:CODE", STD_STREAMS_ACCEPTED)
        out[int(rank)] = int(code)
    return out


def root_comm_id(addr: str) -> str:
    """torch-neuronx's NEURON_RT_ROOT_COMM_ID for a master address (IPv6 in brackets)."""
    if ":" in addr and not addr.startswith("["):
        addr = f"[{addr}]"
    return f"{addr}:{ROOT_COMM_PORT}"


# Ports are picked below the kernel's ephemeral range, where only an explicit bind
# lands: a port the kernel hands out for bind(0) comes from the range every outgoing
# connection's local end is drawn from, so one could take it between the pick and the
# job's store binding it (seen in CI: "Address already in use").
_PORT_FLOOR = 10000
_PORT_TRIES = 50


def free_port() -> int:
    """A TCP port free right now on this host (for a job's MASTER_PORT), below the
    ephemeral range when there is room for one."""
    top = _ephemeral_start()
    if top - 1 > _PORT_FLOOR:
        # the system's randomness: jobs started together with one seed pick apart
        for port in random.SystemRandom().sample(range(_PORT_FLOOR, top), _PORT_TRIES):
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768   # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


# -- configuration of one job -------------------------------------------------------


@dataclass
class LaunchConfig:
    """Everything :func:`run` needs; ``cmd`` is the full argv of every rank."""

    cmd: List[str]
    slices: List[Tuple[int, ...]]
    run_id: str
    log_dir: str
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    max_restarts: int = 0
    monitor_interval: float = 0.1
    stop_timeout: float = 30.0
    redirects: Dict[Optional[int], int] = field(default_factory=dict)
    tee: Dict[Optional[int], int] = field(default_factory=dict)
    env: Optional[Mapping[str, str]] = None

    @property
    def nproc(self) -> int:
        return len(self.slices)


def stream_code(table: Mapping[Optional[int], int], local_rank: int) -> int:
    """The --redirects/--tee code that applies to ``local_rank``."""
    return table.get(local_rank, table.get(None, NONE))


# -- one rank process -----------------------------------------------------------------


@dataclass
class _Rank:
    local_rank: int
    cores: Tuple[int, ...]
    dir: str
    proc: Optional[subprocess.Popen] = None
    exitcode: Optional[int] = None
    ended: Optional[float] = None
    stopped: bool = False           # exited after we asked it to stop
    pumps: List[threading.Thread] = field(default_factory=list)
    files: List[IO[bytes]] = field(default_factory=list)

    @property
    def error_file(self) -> str:
        return os.path.join(self.dir, "error.json")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.exitcode is None

    @property
    def failed(self) -> bool:
        return self.exitcode not in (None, 0) and not self.stopped


def _rank_env(cfg: LaunchConfig, rank: _Rank, attempt: int) -> Dict[str, str]:
    env = dict(os.environ if cfg.env is None else cfg.env)
    env.pop(visibility.ENV_NUM, None)
    per = len(rank.cores)
    env.update({
        visibility.ENV_VISIBLE: span(rank.cores, none=''),
        visibility.ENV_SLICED_BY: "neuronmp-run",
        "LOCAL_RANK": str(rank.local_rank),
        "RANK": str(rank.local_rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank.local_rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(cfg.nproc),
        "WORLD_SIZE": str(cfg.nproc),
        "ROLE_WORLD_SIZE": str(cfg.nproc),
        "MASTER_ADDR": cfg.master_addr,
        "MASTER_PORT": str(cfg.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
        "TORCHELASTIC_RUN_ID": cfg.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        errorfile.ENV_ERROR_FILE: rank.error_file,
    })
    env.setdefault("NEURON_RT_ROOT_COMM_ID", root_comm_id(cfg.master_addr))
    # torchrun sets 1 for several ranks; a rank here owns `per` cores' worth of CPUs
    env.setdefault("OMP_NUM_THREADS", str(per))
    return env


def _die_with_parent_hook():
    """A preexec_fn: own process group, and SIGKILL when the launcher dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    parent = os.getpid()

    def hook():
        os.setpgid(0, 0)
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)

    return hook


def _spawn(cfg: LaunchConfig, rank: _Rank, attempt: int, out_lock: threading.Lock) -> None:
    os.makedirs(rank.dir, exist_ok=True)
    streams = {}
    for name, bit, console in (("stdout", STDOUT, sys.stdout), ("stderr", STDERR, sys.stderr)):
        path = os.path.join(rank.dir, f"{name}.log")
        if stream_code(cfg.redirects, rank.local_rank) & bit:
            f = open(path, "wb")
            rank.files.append(f)
            streams[name] = f
        elif stream_code(cfg.tee, rank.local_rank) & bit:
            f = open(path, "wb")
            rank.files.append(f)
            streams[name] = (subprocess.PIPE, f, console)
        else:
            streams[name] = None
    rank.proc = subprocess.Popen(
        cfg.cmd,
        env=_rank_env(cfg, rank, attempt),
        stdin=subprocess.DEVNULL,
        stdout=streams["stdout"][0] if isinstance(streams["stdout"], tuple) else streams["stdout"],
        stderr=streams["stderr"][0] if isinstance(streams["stderr"], tuple) else streams["stderr"],
        preexec_fn=_die_with_parent_hook(),
        close_fds=True,
    )
    prefix = f"[rank{rank.local_rank}]:".encode()
    for name in ("stdout", "stderr"):
        if isinstance(streams[name], tuple):
            _, logfile, console = streams[name]
            pipe = getattr(rank.proc, name)
            pump = threading.Thread(target=_pump, args=(pipe, logfile, console, prefix, out_lock),
                                    name=f"tee-{rank.local_rank}-{name}", daemon=True)
            pump.start()
            rank.pumps.append(pump)


def _pump(pipe: IO[bytes], logfile: IO[bytes], console, prefix: bytes,
          lock: threading.Lock) -> None:
    """Copy a rank's stream to its log file and, prefixed, to the launcher's console."""
    out = getattr(console, "buffer", console)
    try:
        for line in iter(pipe.readline, b""):
            logfile.write(line)
            logfile.flush()
            with lock:
                out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                out.flush()
    except (OSError, ValueError):
        pass  # console or file closed under us at shutdown: nothing left to copy to
    finally:
        pipe.close()


def _finish(rank: _Rank) -> None:
    for pump in rank.pumps:
        pump.join(timeout=2.0)  # a grandchild holding the pipe must not hang us
    for f in rank.files:
        f.close()
    rank.files.clear()


# -- signals: wake the monitor on SIGCHLD and on the launcher's own signals ---------


class _SignalWatch:
    """Self-pipe wakeups; remembers the stop signals the launcher received."""

    def __init__(self):
        self.received: List[int] = []
        self._old = {}

    def __enter__(self) -> _SignalWatch:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._old_fd = signal.set_wakeup_fd(self._w)
        for sig in _STOP_SIGNALS + (signal.SIGCHLD,):
            self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._r)
        os.close(self._w)

    def _on_signal(self, signum, frame) -> None:
        if signum != signal.SIGCHLD:
            self.received.append(signum)

    def wait(self, timeout: float) -> None:
        """Sleep until a signal arrives or ``timeout`` seconds pass."""
        try:
            select.select([self._r], [], [], max(0.0, timeout))
            while os.read(self._r, 512):
                pass
        except BlockingIOError:
            pass
        except OSError as exc:
            if exc.errno != errno.EINTR:
                raise


# -- one attempt: a group of ranks ---------------------------------------------------


class _Group:
    def __init__(self, cfg: LaunchConfig, attempt: int, watch: _SignalWatch):
        self.cfg = cfg
        self.attempt = attempt
        self.watch = watch
        base = os.path.join(cfg.log_dir, cfg.run_id, f"attempt_{attempt}")
        self.ranks = [_Rank(i, cores, os.path.join(base, str(i)))
                      for i, cores in enumerate(cfg.slices)]
        self._lock = threading.Lock()
        self.start_error: Optional[str] = None

    def start(self) -> None:
        for rank in self.ranks:
            try:
                _spawn(self.cfg, rank, self.attempt, self._lock)
            except OSError as exc:
                self.start_error = f"cannot start rank {rank.local_rank} ({self.cfg.cmd[0]}): {exc}"
                rank.exitcode, rank.ended = 127, time.time()
                return

    def reap(self) -> None:
        for rank in self.ranks:
            if rank.running:
                code = rank.proc.poll()
                if code is not None:
                    rank.exitcode, rank.ended = code, time.time()
                    _finish(rank)

    def wait(self) -> str:
        """Watch until every rank succeeded ('ok'), one failed ('failed') or we were signalled."""
        while True:
            self.reap()
            if self.watch.received:
                return "signalled"
            if self.start_error or any(r.failed for r in self.ranks):
                return "failed"
            if all(r.exitcode == 0 for r in self.ranks):
                return "ok"
            self.watch.wait(self.cfg.monitor_interval)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop every running rank: ``sig``, then SIGKILL at the shared deadline."""
        live = [r for r in self.ranks if r.running]
        for rank in live:
            rank.stopped = True
        seen = len(self.watch.received)

        def running(rank: _Rank) -> bool:
            self.reap()
            return rank.running

        stop_in_stages(live, ask=lambda rank: _killpg(rank, sig), running=running,
                       kill=lambda rank: _killpg(rank, signal.SIGKILL),
                       grace=self.cfg.stop_timeout, poll=self.watch.wait,
                       # asked again while stopping: do not wait out the deadline
                       give_up=lambda: len(self.watch.received) > seen)
        for rank in live:
            if rank.running:
                try:
                    rank.exitcode = rank.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:  # unkillable (D state): report, move on
                    rank.exitcode = -signal.SIGKILL
                rank.ended = time.time()
                _finish(rank)

    def first_failure(self) -> Optional[_Rank]:
        failed = [r for r in self.ranks if r.failed]
        if not failed:
            return None

        def when(rank: _Rank) -> float:
            rec = errorfile.read_error_file(rank.error_file)
            return rec.timestamp if rec and rec.timestamp else rank.ended or time.time()

        return min(failed, key=lambda r: (when(r), r.ended or 0.0))


def _killpg(rank: _Rank, sig: int) -> None:
    try:
        os.killpg(rank.proc.pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:  # group already gone and the id reused: signal the rank alone
        rank.proc.send_signal(sig)


# -- the job ----------------------------------------------------------------------------


def run(cfg: LaunchConfig) -> int:
    """Run the job to completion; returns the launcher's exit code."""
    log = sys.stderr
    with _SignalWatch() as watch:
        for attempt in range(cfg.max_restarts + 1):
            group = _Group(cfg, attempt, watch)
            group.start()
            outcome = group.wait()
            if outcome == "ok":
                return 0
            if outcome == "signalled":
                sig = watch.received[0]
                print(f"neuronmp-run: received {signal_name(sig)}, stopping "
                      f"{sum(r.running for r in group.ranks)} rank(s)", file=log, flush=True)
                group.stop(sig)
                return 128 + sig
            group.stop(signal.SIGTERM)
            if watch.received:
                return 128 + watch.received[0]
            culprit = group.first_failure()
            if group.start_error:
                print(f"neuronmp-run: {group.start_error}", file=log, flush=True)
                return 1
            if attempt < cfg.max_restarts:
                print(f"neuronmp-run: rank {culprit.local_rank} (pid {culprit.proc.pid}) "
                      f"{_how(culprit.exitcode)}; restarting all {cfg.nproc} rank(s) "
                      f"(restart {attempt + 1} of {cfg.max_restarts})", file=log, flush=True)
                continue
            print(summary(cfg, group, culprit), file=log, flush=True)
            return 1
    return 1


def _how(exitcode: int) -> str:
    """'was killed by signal SIGTERM', 'exited with code 3': supervise's wording in a
    sentence about a rank."""
    said = describe_exit(exitcode)
    return f"was {said}" if exitcode < 0 else f"exited with {said}"


def _unrecorded(rank: _Rank, stderr_tail: List[str]) -> str:
    """Why a failed rank left no error file: the hint to record it only where an
    exception went unrecorded (a traceback on stderr), else what did happen."""
    if any("Traceback (most recent call last)" in line for line in stderr_tail):
        return ("decorate the rank's entry point with neuronmp.record to see its "
                "exception here")
    if rank.exitcode < 0:
        return f"the rank was {describe_exit(rank.exitcode)}, so it raised nothing"
    return f"the rank ended with {describe_exit(rank.exitcode)} without raising an exception"


def summary(cfg: LaunchConfig, group: _Group, culprit: _Rank) -> str:
    """The failure report: the root-cause rank first, then what became of the others."""
    rec = errorfile.read_error_file(culprit.error_file)
    when = rec.timestamp if rec and rec.timestamp else culprit.ended
    stamp = datetime.datetime.fromtimestamp(when).isoformat(timespec="seconds") if when else "?"
    code = (f"{culprit.exitcode} (signal {signal_name(-culprit.exitcode)})"
            if culprit.exitcode < 0 else str(culprit.exitcode))
    lines = [
        "=" * 72,
        f"neuronmp-run: job {cfg.run_id} failed "
        f"(attempt {group.attempt + 1} of {cfg.max_restarts + 1})",
        "Root cause (first failing rank):",
        f"  rank       : {culprit.local_rank} (local_rank {culprit.local_rank})",
        f"  pid        : {culprit.proc.pid}",
        f"  exit code  : {code}",
        f"  cores      : {span(culprit.cores, none='')}",
        f"  host       : {socket.gethostname()}",
        f"  time       : {stamp}",
    ]
    if rec:
        lines.append(f"  error file : {culprit.error_file}")
        lines.append(f"  error      : {rec.message}")
        if rec.traceback:
            lines.append("  traceback  :")
            lines.extend("    " + ln for ln in rec.traceback.rstrip().splitlines())
    else:
        tail = _tail(os.path.join(culprit.dir, "stderr.log"))
        whole = _tail(os.path.join(culprit.dir, "stderr.log"), 200)
        lines.append(f"  error      : <not recorded> ({_unrecorded(culprit, whole)})")
        if tail:
            lines.append("  stderr tail:")
            lines.extend("    " + ln for ln in tail)
    others = [r for r in group.ranks if r is not culprit]
    if others:
        lines.append("Other ranks:")
        for r in others:
            if r.proc is None:
                state = "not started"
            elif r.stopped:
                state = f"stopped by the launcher ({_how(r.exitcode)})"
            elif r.exitcode == 0:
                state = "exited with code 0"
            else:
                state = _how(r.exitcode)
                rr = errorfile.read_error_file(r.error_file)
                if rr:
                    state += f": {rr.message}"
            pid = f"pid {r.proc.pid}" if r.proc else "no pid"
            lines.append(f"  rank {r.local_rank} ({pid}): {state}")
    lines.append("=" * 72)
    return "\n".join(lines)


def _tail(path: str, n: int = 10) -> List[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            return f.read().decode(errors="replace").splitlines()[-n:]
    except OSError:
        return []
