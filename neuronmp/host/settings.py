"""Every environment variable neuronmp reads (``NEURONMP_*``, ``NEURON_RT_*``, torchrun's,
TorchNeuron's ``TORCH_NEURONX_*``, the host's directories), parsed into one frozen object.

Only this module reads ``os.environ`` (tests/host/test_settings.py holds the rest of the
package to that and lists the exceptions); code that builds a child's environment
writes it.

    os.environ --parse()--> Settings (frozen)       every field; a bad value: ConfigError
                               |                    naming the variable
    runtime.init() ---pin()---+--> current(), get(field)   the runtime's, until shutdown()
    no runtime (tools, workers) --> get(field)      that field parsed from os.environ at
                                                    the call, again only when it changed

"Once per runtime": ``runtime.init()`` parses every variable once (a bad value of any
of them fails the init, naming it) and pins the result; every reader (the pool, the
transport, the server, the collectives) sees that object until ``runtime.shutdown()``,
so a change to ``os.environ`` while a runtime is up does not half-apply (a pool's
rings one size, its next worker's another).  Tests and users who change the
environment between runtimes (shutdown, set, init) get the new values.  Without a
runtime (``neuronmp-ls``, a worker process, a test) ``get(field)`` parses that one
field as the environment is at the call, so a bad value fails only the code that
reads it, as it did when each module read its own variable.

The visibility fields (``NEURON_RT_VISIBLE_CORES``, ``NEURON_RT_NUM_CORES``, torchrun's
``LOCAL_RANK``) are per process and per runtime: each process has its own (neuronmp-run
gives each rank its share), and a process that shuts its runtime down and sets other
cores gets those at its next ``init()``.

A few fields are *live* (:data:`LIVE`): TorchNeuron's switches (``TORCH_NEURONX_*``,
``NEURON_LAUNCH_BLOCKING``), which TorchNeuron reads at each call and code flips while
the device runs, and the temp directories, which a test fixture moves.  ``get()``
never pins them: each call compares the variables with the last ones it parsed and
parses again only when they changed.

The grammars are envconfig's (numbers, seconds, sizes) and the owning modules'
(topology names, core lists, latency models); this module only says which variable
goes with which grammar, default and range.  Imports no torch.
"""
from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from ..errors import ConfigError
from . import devicetime as _devicetime
from . import envconfig
from . import topology as _topology
from . import visibility as _visibility
from .devicetime import DeviceTime
from .topology import Topology
from .visibility import Request

#: NEURONMP_PROVIDE's names (the start-up hook, _neuronmp_provide.py, reads the same list)
PROVIDE_ACCEPTED = ("torch_neuronx", "torch_neuron", "torchneuron")
WEIGHTS_AUTO, WEIGHTS_SHM = "auto", "shm"
_LABEL = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):([0-9]{1,5})")


@dataclass(frozen=True)
class Settings:
    """neuronmp's view of its environment: one field per setting, each already checked.

    Build with :func:`parse` (any mapping) or read the process's with :func:`current`.
    """

    #: NEURONMP_TOPOLOGY, NEURON_LOGICAL_NC_CONFIG: the (emulated) host
    topology: Topology
    #: NEURON_RT_VISIBLE_CORES, NEURON_RT_NUM_CORES, NEURONMP_SLICED_BY, LOCAL_RANK,
    #: LOCAL_WORLD_SIZE: the cores this process asks for (per process, per runtime)
    request: Request
    #: NEURON_RT_VISIBLE_CORES as set, before any torchrun share (None: unset or blank)
    visible_cores: Optional[Tuple[int, ...]]
    #: LOCAL_RANK, LOCAL_WORLD_SIZE: torchrun's (local rank, local world size), None
    #: unless both are set
    local_share: Optional[Tuple[int, int]]
    #: GROUP_RANK: torchrun's rank of this host's agent (0 when unset)
    group_rank: int
    #: TORCHELASTIC_ERROR_FILE: where @record writes a failing rank's error (None: unset)
    error_file: Optional[str]
    #: NEURONMP_SLICED_BY: who already sliced this rank's cores (None: nobody)
    sliced_by: Optional[str]
    #: NEURON_RT_EXEC_TIMEOUT: seconds one execution may take (0: no bound)
    exec_timeout: float
    #: NEURON_RT_ROOT_COMM_ID: ``host:port`` of the collectives' root (None: unset)
    root_comm_id: Optional[str]
    #: NEURONMP_RUNTIME_DIR: made absolute (None: the default paths.py picks)
    runtime_dir: Optional[str]
    #: NEURONMP_RESERVE_TIMEOUT: seconds to wait for busy cores
    reserve_timeout: float
    #: NEURONMP_RING_BYTES: bytes of each worker ring
    ring_bytes: int
    #: NEURONMP_WORKER_START_TIMEOUT: seconds a worker may take to start
    worker_start_timeout: float
    #: NEURONMP_WAIT_SPIN_US: a caller's spin on its only busy core, in seconds
    wait_spin: float
    #: NEURONMP_WORKER_SPIN_US: an idle worker's spin, in seconds
    worker_spin: float
    #: NEURONMP_WORKER_KEEP_MB: MiB a worker keeps for reuse (0: glibc's defaults)
    worker_keep_mb: int
    #: NEURONMP_IPC_SPIN_US: the transport's spin before a futex sleep, in seconds
    ipc_spin: float
    #: NEURONMP_IPC_PAUSE_US: the transport's pause between spins, in seconds (<= ipc_spin)
    ipc_pause: float
    #: NEURONMP_SHARE_WEIGHTS: one read-only copy of a model's weights for all its cores
    share_weights: bool
    #: NEURONMP_SHM_MAX_REGIONS: system shared-memory regions neuronmp-serve registers
    shm_max_regions: int
    #: NEURONMP_WEIGHTS_DIR: "auto", "shm" or a normalized absolute path
    weights_dir: str
    #: NEURONMP_COLLECTIVE_SLOT_KB: the neuron process group's slot per rank, in bytes
    collective_slot_bytes: int
    #: NEURONMP_COLLECTIVE_SPIN_US: how long a rank waiting for its peers spins, in seconds
    collective_spin: float
    #: NEURONMP_DEVICE_TIME_US: the host-wide latency model (None: computed time only)
    device_time: Optional[DeviceTime]
    #: NEURONMP_PROVIDE: the SDK modules neuronmp stands in for
    provide: Tuple[str, ...]
    #: NEURONMP_TORCHNEURON_CACHE: made absolute (None: under $XDG_CACHE_HOME)
    torchneuron_cache: Optional[str]
    #: NEURONMP_TORCHNEURON_RELAXED: the neuron device runs what Trainium refuses, with
    #: the CPU's semantics (False: it refuses and rounds as TorchNeuron on Trainium does)
    torchneuron_relaxed: bool
    #: NEURON_PROCESS_TAG: what monitors call this process (None: its pid)
    process_tag: Optional[str]
    #: XDG_RUNTIME_DIR: the runtime directory's fallback parent (None: unset)
    xdg_runtime_dir: Optional[str]
    #: TMPDIR, TEMP, TMP: the temp directories set, in that order, made absolute (live)
    temp_dirs: Tuple[str, ...]
    #: XDG_CACHE_HOME: the user's cache directory (~/.cache when unset or relative)
    cache_home: str
    #: CXX: the C++ compiler that builds the device's extension
    cxx: str
    #: TorchNeuron's switches, read as TorchNeuron does: "1" turns each on (live)
    #: TORCH_NEURONX_MLIR_ATEN_OPS: eager ops lower through torch-mlir
    mlir_aten_ops: bool
    #: TORCH_NEURONX_ENABLE_STABLEHLO: lowering goes through StableHLO ("0"/"false": off)
    stablehlo: bool
    #: NEURON_LAUNCH_BLOCKING: launches block
    launch_blocking: bool
    #: TORCH_NEURONX_SKIP_OP_PRECONDITIONS: op precondition checks are skipped
    skip_op_preconditions: bool
    #: TORCH_NEURONX_DISABLE_NEFF_CACHE: "1", "true" or "yes" turns the NEFF cache off
    neff_cache_disabled: bool
    #: TORCH_NEURONX_ATEN_GMM_ALIGN: grouped-matmul offset alignment
    gmm_align: int
    #: TORCH_NEURONX_DYNAMO_DISABLE_CPU_AUTOCOPY: a compiled call refuses CPU inputs
    cpu_autocopy_disabled: bool
    #: TORCH_NEURONX_RETAIN_DEVICE_MODE: a CPU-only compiled call returns CPU outputs
    retain_device_mode: bool


#: each variable the parser reads -> the field it sets
VARIABLES: Dict[str, str] = {
    _topology.ENV_TOPOLOGY: "topology",
    _topology.ENV_LNC: "topology",
    _visibility.ENV_VISIBLE: "visible_cores",
    _visibility.ENV_NUM: "request",
    _visibility.ENV_LOCAL_RANK: "local_share",
    _visibility.ENV_LOCAL_WORLD_SIZE: "local_share",
    "GROUP_RANK": "group_rank",
    "TORCHELASTIC_ERROR_FILE": "error_file",
    _visibility.ENV_SLICED_BY: "sliced_by",
    "NEURON_RT_EXEC_TIMEOUT": "exec_timeout",
    "NEURON_RT_ROOT_COMM_ID": "root_comm_id",
    "NEURONMP_RUNTIME_DIR": "runtime_dir",
    "NEURONMP_RESERVE_TIMEOUT": "reserve_timeout",
    "NEURONMP_RING_BYTES": "ring_bytes",
    "NEURONMP_WORKER_START_TIMEOUT": "worker_start_timeout",
    "NEURONMP_WAIT_SPIN_US": "wait_spin",
    "NEURONMP_WORKER_SPIN_US": "worker_spin",
    "NEURONMP_WORKER_KEEP_MB": "worker_keep_mb",
    "NEURONMP_IPC_SPIN_US": "ipc_spin",
    "NEURONMP_IPC_PAUSE_US": "ipc_pause",
    "NEURONMP_SHARE_WEIGHTS": "share_weights",
    "NEURONMP_SHM_MAX_REGIONS": "shm_max_regions",
    "NEURONMP_WEIGHTS_DIR": "weights_dir",
    "NEURONMP_COLLECTIVE_SLOT_KB": "collective_slot_bytes",
    "NEURONMP_COLLECTIVE_SPIN_US": "collective_spin",
    _devicetime.ENV: "device_time",
    "NEURONMP_PROVIDE": "provide",
    "NEURONMP_TORCHNEURON_CACHE": "torchneuron_cache",
    "NEURONMP_TORCHNEURON_RELAXED": "torchneuron_relaxed",
    "NEURON_PROCESS_TAG": "process_tag",
    "XDG_RUNTIME_DIR": "xdg_runtime_dir",
    "TMPDIR": "temp_dirs",
    "TEMP": "temp_dirs",
    "TMP": "temp_dirs",
    "XDG_CACHE_HOME": "cache_home",
    "CXX": "cxx",
    "TORCH_NEURONX_MLIR_ATEN_OPS": "mlir_aten_ops",
    "TORCH_NEURONX_ENABLE_STABLEHLO": "stablehlo",
    "NEURON_LAUNCH_BLOCKING": "launch_blocking",
    "TORCH_NEURONX_SKIP_OP_PRECONDITIONS": "skip_op_preconditions",
    "TORCH_NEURONX_DISABLE_NEFF_CACHE": "neff_cache_disabled",
    "TORCH_NEURONX_ATEN_GMM_ALIGN": "gmm_align",
    "TORCH_NEURONX_DYNAMO_DISABLE_CPU_AUTOCOPY": "cpu_autocopy_disabled",
    "TORCH_NEURONX_RETAIN_DEVICE_MODE": "retain_device_mode",
}

#: fields get() reads from the environment even while a runtime is up (module docstring)
LIVE = frozenset({"temp_dirs", "mlir_aten_ops", "stablehlo", "launch_blocking",
                  "skip_op_preconditions", "neff_cache_disabled", "gmm_align",
                  "cpu_autocopy_disabled", "retain_device_mode"})

RESERVE_TIMEOUT_ACCEPTED = (f"a number of seconds >= 0 and <= {envconfig.MAX_SECONDS:.0f} "
                            "(0, the default, refuses at once)")


def _us(name: str, default: float, high: float = 1e6):
    return lambda env: envconfig.microseconds(name, default, 0, high, environ=env) * 1e-6


#: each field's parser, from a mapping of variables
_PARSERS: Dict[str, Callable[[Mapping[str, str]], Any]] = {
    "topology": _topology.from_env,
    "request": lambda env: _visibility.request_from_env(_topology.from_env(env), env),
    "visible_cores": lambda env: _visible_cores(env),
    "local_share": lambda env: _local_share(env),
    "group_rank": lambda env: envconfig.integer(
        "GROUP_RANK", 0, 0, 1 << 20, environ=env,
        accepted="torchrun's whole-number rank of this host's agent, 0 or more"),
    "error_file": lambda env: _text(env, "TORCHELASTIC_ERROR_FILE"),
    "sliced_by": lambda env: _label(env, _visibility.ENV_SLICED_BY),
    "exec_timeout": lambda env: envconfig.seconds("NEURON_RT_EXEC_TIMEOUT", 30.0, environ=env),
    "root_comm_id": lambda env: _host_port(env, "NEURON_RT_ROOT_COMM_ID"),
    "runtime_dir": lambda env: _directory(env, "NEURONMP_RUNTIME_DIR",
                                          "a directory of this user's"),
    "reserve_timeout": lambda env: envconfig.seconds(
        "NEURONMP_RESERVE_TIMEOUT", 0.0, environ=env, accepted=RESERVE_TIMEOUT_ACCEPTED),
    "ring_bytes": lambda env: envconfig.size("NEURONMP_RING_BYTES", 8 << 20, 64 << 10, 1 << 40,
                                             environ=env),
    "worker_start_timeout": lambda env: envconfig.seconds(
        "NEURONMP_WORKER_START_TIMEOUT", 120.0, low=0.001, environ=env),
    "wait_spin": _us("NEURONMP_WAIT_SPIN_US", 2000.0),
    "worker_spin": _us("NEURONMP_WORKER_SPIN_US", 200.0),
    "worker_keep_mb": lambda env: envconfig.integer(
        "NEURONMP_WORKER_KEEP_MB", 1024, 0, 1 << 20, environ=env,
        accepted="the megabytes a worker keeps for reuse, 0 to keep glibc's defaults"),
    # beyond 10 ms a spin only burns the CPU a sleep frees
    "ipc_spin": _us("NEURONMP_IPC_SPIN_US", 50, 10_000),
    "ipc_pause": lambda env: min(_us("NEURONMP_IPC_SPIN_US", 50, 10_000)(env),
                                 _us("NEURONMP_IPC_PAUSE_US", 20, 10_000)(env)),
    "share_weights": lambda env: bool(envconfig.integer(
        "NEURONMP_SHARE_WEIGHTS", 1, 0, 1, environ=env,
        accepted="1 to map one read-only copy of a model's weights into all its cores, "
                 "0 to give each core its own copy")),
    "shm_max_regions": lambda env: envconfig.integer(
        "NEURONMP_SHM_MAX_REGIONS", 256, 1, 1 << 16, environ=env,
        accepted="a whole number of regions from 1 to 65536"),
    "weights_dir": lambda env: _weights_dir(env),
    "collective_slot_bytes": lambda env: envconfig.integer(
        "NEURONMP_COLLECTIVE_SLOT_KB", 2048, 64, 1 << 20, environ=env) << 10,
    "collective_spin": _us("NEURONMP_COLLECTIVE_SPIN_US", 50, 100_000),
    "device_time": _devicetime.from_env,
    "provide": lambda env: _provide(env),
    "torchneuron_cache": lambda env: _directory(env, "NEURONMP_TORCHNEURON_CACHE",
                                                "a directory"),
    "torchneuron_relaxed": lambda env: bool(envconfig.integer(
        "NEURONMP_TORCHNEURON_RELAXED", 0, 0, 1, environ=env,
        accepted="0 for Trainium's refusals and numerics (the default), 1 for the CPU's")),
    "process_tag": lambda env: _tag(env, "NEURON_PROCESS_TAG"),
    "xdg_runtime_dir": lambda env: _text(env, "XDG_RUNTIME_DIR"),
    "temp_dirs": lambda env: tuple(os.path.abspath(t) for t in (
        _text(env, n) for n in ("TMPDIR", "TEMP", "TMP")) if t is not None),
    "cache_home": lambda env: _cache_home(env),
    "cxx": lambda env: _text(env, "CXX") or "c++",
    "mlir_aten_ops": lambda env: env.get("TORCH_NEURONX_MLIR_ATEN_OPS") == "1",
    "stablehlo": lambda env: env.get("TORCH_NEURONX_ENABLE_STABLEHLO", "1") not in ("0", "false"),
    "launch_blocking": lambda env: env.get("NEURON_LAUNCH_BLOCKING") == "1",
    "skip_op_preconditions": lambda env: env.get("TORCH_NEURONX_SKIP_OP_PRECONDITIONS") == "1",
    "neff_cache_disabled": lambda env: (env.get("TORCH_NEURONX_DISABLE_NEFF_CACHE") or "")
    .lower() in ("1", "true", "yes"),
    "gmm_align": lambda env: envconfig.integer(
        "TORCH_NEURONX_ATEN_GMM_ALIGN", 128, 1, 1 << 20, environ=env,
        accepted="a whole number of elements from 1 to 1048576 (TorchNeuron's default: 128)"),
    "cpu_autocopy_disabled": lambda env: env.get(
        "TORCH_NEURONX_DYNAMO_DISABLE_CPU_AUTOCOPY") == "1",
    "retain_device_mode": lambda env: env.get("TORCH_NEURONX_RETAIN_DEVICE_MODE") == "1",
}

#: each field -> the variables its parser reads
_INPUTS: Dict[str, Tuple[str, ...]] = {
    f: tuple(v for v, g in VARIABLES.items() if g == f) for f in _PARSERS}
_INPUTS["request"] += (_INPUTS["topology"] + _INPUTS["visible_cores"]
                       + _INPUTS["local_share"] + _INPUTS["sliced_by"])
_INPUTS["visible_cores"] += _INPUTS["topology"]
_INPUTS["ipc_pause"] += _INPUTS["ipc_spin"]
_INPUTS["cache_home"] += ("HOME",)   # expanduser's
#: fields whose value depends on the working directory too
_RELATIVE = frozenset({"runtime_dir", "torchneuron_cache", "temp_dirs"})


def parse(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Every setting from ``environ`` (default ``os.environ``), in the order of the
    fields; the first bad value is a ConfigError (VisibilityError, TopologyError)
    naming the variable, quoting the value and saying what is accepted."""
    env = os.environ if environ is None else environ
    return Settings(**{name: parse_field(name, env) for name in _PARSERS})


def parse_field(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """One field of :class:`Settings` from ``environ`` (default ``os.environ``)."""
    return _PARSERS[name](os.environ if environ is None else environ)


# -- this process's settings: pinned by the runtime, else the environment's ---------------

_lock = threading.Lock()
_pinned: Optional[Settings] = None
_memo: Dict[str, Tuple[tuple, Any]] = {}


def current() -> Settings:
    """The settings of this process: its runtime's while one is up (see the module
    docstring), else every one parsed from the environment as it is now."""
    pinned = _pinned
    return pinned if pinned is not None else parse()


def get(name: str) -> Any:
    """One setting of this process: its runtime's while one is up, else parsed from the
    environment as it is now (again only when one of its variables changed).  Readers
    use this rather than ``current()`` so that, without a runtime, a bad value fails
    only the code that reads that variable (``neuronmp-ls`` with a bad spin setting)."""
    pinned = _pinned
    if pinned is not None and name not in LIVE:
        return getattr(pinned, name)
    key = tuple(os.environ.get(v) for v in _INPUTS[name])
    if name in _RELATIVE:   # a relative directory is resolved against the working one
        key += (os.getcwd(),)
    memo = _memo.get(name)
    if memo is not None and memo[0] == key:
        return memo[1]
    value = parse_field(name)
    _memo[name] = (key, value)
    return value


def pin(value: Settings) -> None:
    """Make ``value`` what :func:`current` and :func:`get` return until :func:`unpin`
    (``runtime.init``)."""
    global _pinned
    with _lock:
        _pinned = value


def unpin(value: Optional[Settings] = None) -> None:
    """Back to the environment's settings (runtime shutdown, a forked child); with
    ``value``, only if that is what is pinned (a runtime closing late must not unpin
    the next one's)."""
    global _pinned
    with _lock:
        if value is None or _pinned is value:
            _pinned = None


def field_of(variable: str) -> str:
    """The :class:`Settings` field a variable sets (KeyError for one neuronmp does not read)."""
    return VARIABLES[variable]


# -- grammars of the text-valued variables -----------------------------------------------


def _text(env: Mapping[str, str], name: str) -> Optional[str]:
    raw = env.get(name)
    return None if raw is None or not raw.strip() else raw.strip()


def _visible_cores(env: Mapping[str, str]) -> Optional[Tuple[int, ...]]:
    text = _text(env, _visibility.ENV_VISIBLE)
    if text is None:
        return None
    return tuple(_visibility.parse_visible_cores(text, _topology.from_env(env).num_cores))


def _local_share(env: Mapping[str, str]) -> Optional[Tuple[int, int]]:
    rank = env.get(_visibility.ENV_LOCAL_RANK)
    size = env.get(_visibility.ENV_LOCAL_WORLD_SIZE)
    if rank is None or size is None:
        return None
    return _visibility.local_rank_and_size(rank, size)


def _cache_home(env: Mapping[str, str]) -> str:
    # the XDG spec: a relative XDG_CACHE_HOME is invalid and to be ignored
    text = _text(env, "XDG_CACHE_HOME")
    if text is not None and os.path.isabs(text):
        return text
    return os.path.join(os.path.expanduser("~"), ".cache")


def _label(env: Mapping[str, str], name: str) -> Optional[str]:
    text = _text(env, name)
    if text is not None and not _LABEL.fullmatch(text):
        raise ConfigError(name, env[name], "it is not a label",
                          "up to 64 ASCII letters, digits, '-', '_' or '.' (such as "
                          "'neuronmp-run')")
    return text


def _tag(env: Mapping[str, str], name: str) -> Optional[str]:
    """The SDK's application tag: up to 255 printable characters."""
    text = _text(env, name)
    if text is not None and (len(text) > 255 or not text.isprintable()):
        raise ConfigError(name, env[name], "it is not a tag",
                          "up to 255 printable characters (such as 'my_app_1')")
    return text


def _host_port(env: Mapping[str, str], name: str) -> Optional[str]:
    text = _text(env, name)
    if text is None:
        return None
    m = _HOST_PORT.fullmatch(text)
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise ConfigError(name, env[name], "it is not host:port",
                          "host:port with a port from 1 to 65535 (such as 10.0.0.1:62182)")
    return text


def _directory(env: Mapping[str, str], name: str, what: str) -> Optional[str]:
    """An absolute path (a relative one is taken from the working directory now)."""
    text = _text(env, name)
    if text is None:
        return None
    path = os.path.abspath(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(name, env[name], "it names a file, not a directory",
                          f"the path of {what} (made when missing)")
    return path


def _weights_dir(env: Mapping[str, str]) -> str:
    name = "NEURONMP_WEIGHTS_DIR"
    text = _text(env, name)
    if text in (None, WEIGHTS_AUTO):
        return WEIGHTS_AUTO
    if text == WEIGHTS_SHM:
        return WEIGHTS_SHM
    if not os.path.isabs(text):
        raise ConfigError(name, text, "a relative path",
                          "'auto', 'shm', or the absolute path of a directory of this user's")
    return os.path.normpath(text)


def _provide(env: Mapping[str, str]) -> Tuple[str, ...]:
    name = "NEURONMP_PROVIDE"
    names = tuple(n.strip() for n in (env.get(name) or "").split(",") if n.strip())
    unknown = [n for n in names if n not in PROVIDE_ACCEPTED]
    if unknown:
        raise ConfigError(name, env[name], f"neuronmp cannot stand in for {', '.join(unknown)}",
                          f"a comma list of {', '.join(PROVIDE_ACCEPTED)}")
    return names
