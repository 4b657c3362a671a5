"""Every exception neuronmp raises, in one place.

Errors carry their facts as fields (the core, the pid, the value) so callers
can act on them without parsing messages, and they pickle with those fields
intact, so an error raised in a worker or a rank crosses a process boundary
unchanged.  Each class keeps the builtin it refines (ValueError for bad input,
RuntimeError for runtime refusals) so code written against torch_neuronx keeps
catching what it caught there.
"""
from __future__ import annotations

import os
import re
from typing import Any, Optional, Sequence, Tuple

from .host.spans import span
from .host.supervise import describe_exit


class NeuronmpError(Exception):
    """Base class of neuronmp's errors.

    Subclasses name their fields in ``_fields``; ``__reduce__`` rebuilds the
    error from them, so the message is computed again on the other side.
    """

    _fields: Tuple[str, ...] = ()

    def __reduce__(self):
        return (_rebuild, (type(self), {f: getattr(self, f) for f in self._fields}))


def _rebuild(cls, fields):
    return cls(**fields)


# -- configuration: topology and visibility ---------------------------------


class ConfigError(NeuronmpError, ValueError):
    """A neuronmp setting (an environment variable such as NEURONMP_RESERVE_TIMEOUT) is invalid."""

    _fields = ("variable", "value", "reason", "accepted")

    def __init__(self, variable: str, value: str, reason: str, accepted: str):
        self.variable = variable
        self.value = value
        self.reason = reason
        self.accepted = accepted
        super().__init__(f"Invalid {variable}={value!r}: {reason}. Accepted: {accepted}")


class TopologyError(ConfigError):
    """``NEURONMP_TOPOLOGY`` names no known instance and is not ``CHIPSxCORES``.

    A ConfigError like every bad setting; ``accepted`` is the tuple of instance names.
    """

    _fields = ("value", "accepted")

    def __init__(self, value: str, accepted: Sequence[str]):
        self.variable = "NEURONMP_TOPOLOGY"
        self.value = value
        self.reason = "it names no known instance and is not CHIPSxCORES"
        self.accepted = tuple(accepted)
        Exception.__init__(
            self,
            f"Invalid NEURONMP_TOPOLOGY={value!r}: expected an instance type "
            f"({', '.join(self.accepted)}) or CHIPSxCORES such as '4x4'"
        )


class ProvideError(NeuronmpError, ImportError):
    """``NEURONMP_PROVIDE`` names a module neuronmp cannot stand in for.

    Raised when the alias is imported (``import torch_neuronx``), not at interpreter
    start: an ImportError, so code that treats the SDK as optional still runs.
    """

    _fields = ("variable", "value", "unknown", "accepted")

    def __init__(self, variable: str, value: str, unknown: Sequence[str],
                 accepted: Sequence[str]):
        self.variable = variable
        self.value = value
        self.unknown = tuple(unknown)
        self.accepted = tuple(accepted)
        super().__init__(
            f"Invalid {variable}={value!r}: unknown module name(s) "
            f"{', '.join(map(repr, self.unknown))}. Accepted: a comma list of "
            f"{', '.join(self.accepted)}")


class ProvideConflictError(NeuronmpError, ImportError):
    """``NEURONMP_PROVIDE`` asks for two stand-ins that cannot share a process.

    The XLA-era ``torch_neuronx`` and the native TorchNeuron one (``torchneuron``) are
    both imported as ``torch_neuronx``; ``torch_neuron`` (Inf1) and ``torchneuron``
    both claim ``torch.neuron``.  ``names`` are the two values, ``clash`` what they share.
    """

    _fields = ("variable", "value", "names", "clash")

    def __init__(self, variable: str, value: str, names: Sequence[str],
                 clash: str = "are both imported as torch_neuronx"):
        self.variable = variable
        self.value = value
        self.names = tuple(names)
        self.clash = clash
        super().__init__(
            f"{variable}={value!r} asks for both {' and '.join(map(repr, self.names))}, "
            f"which {clash} and cannot be active in one process ('torch_neuronx': the "
            "XLA-era torch-neuronx, 'torch_neuron': Inf1's torch-neuron, 'torchneuron': "
            "the native TorchNeuron device); keep one of them")


class DeviceExtensionError(NeuronmpError, RuntimeError):
    """The ``neuron`` device's C++ part could not be built or loaded.

    ``needed`` says what is missing (a C++ compiler, torch's headers);
    ``detail`` carries the build's own message.
    """

    _fields = ("needed", "detail")

    def __init__(self, needed: str, detail: str = ""):
        self.needed = needed
        self.detail = detail
        msg = f"the neuron device needs {needed}, compiled once per user and torch version"
        super().__init__(msg + (f": {detail}" if detail else ""))


class NeuronForkError(NeuronmpError, RuntimeError):
    """A forked child touched the ``neuron`` device its parent had started.

    TorchNeuron's own message: the runtime cannot be re-initialised in a forked
    child; ``parent_pid`` is the process that started it.
    """

    _fields = ("parent_pid",)

    def __init__(self, parent_pid: int = 0):
        self.parent_pid = parent_pid
        super().__init__(
            "Cannot re-initialize Neuron runtime in forked subprocess. To use Neuron with "
            "multiprocessing, use the 'spawn' start method")


class CompileOptionError(NeuronmpError, ValueError):
    """``torch.compile(backend="neuron")`` was given an option TorchNeuron rejects."""

    _fields = ("option", "value", "accepted")

    def __init__(self, option: str, value: Any, accepted: str):
        self.option = option
        self.value = value
        self.accepted = accepted
        super().__init__(
            f"torch.compile(backend='neuron'): {option}={value!r} is not supported "
            f"(accepted: {accepted})")


class VisibilityError(ConfigError):
    """A NEURON_RT_VISIBLE_CORES / NEURON_RT_NUM_CORES value the runtime refuses."""


class DeviceIdError(NeuronmpError, ValueError):
    """A core index given by the user that is malformed or out of range."""

    _fields = ("value", "message")

    def __init__(self, value: Any, message: str):
        self.value = value
        self.message = message
        super().__init__(message)


# -- reservation ---------------------------------------------------------------


class RuntimeDirError(NeuronmpError, PermissionError):
    """The runtime directory, or the directory of shared weights (``what``), is unsafe
    to use (wrong owner or writable by others) or cannot be made."""

    _fields = ("path", "reason", "what")

    def __init__(self, path: str, reason: str, what: str = "runtime directory"):
        self.path = path
        self.reason = reason
        self.what = what
        super().__init__(f"Refusing {what} {path!r}: {reason}")


class ExtensionCacheError(RuntimeDirError):
    """The ``neuron`` device's extension cache (``variable``, normally
    NEURONMP_TORCHNEURON_CACHE), a directory in it or the library found there (``path``)
    is not this user's alone: whoever else can write there could have the next process
    load their code.  ``reason`` says what is wrong with it."""

    _fields = ("path", "reason", "variable")

    def __init__(self, path: str, reason: str, variable: str = "NEURONMP_TORCHNEURON_CACHE"):
        self.variable = variable
        super().__init__(path, reason, f"the neuron device's extension cache ({variable})")
        self.args = (f"{self.args[0]}. Accepted: directories and the library in them owned "
                     f"by this user (uid {os.getuid()}), writable by no one else (such as "
                     f"mode 700 or 755), with no symbolic link among them; point {variable} "
                     "at such a directory (it is made, mode 700, when missing)",)


class UnsafeDirectoryError(NeuronmpError, PermissionError):
    """A directory neuronmp would write an executable into, but that another user can
    write too (they could swap the file for theirs); sticky and ours is safe."""

    _fields = ("path", "mode", "owner")

    def __init__(self, path: str, mode: int, owner: int):
        self.path = path
        self.mode = mode
        self.owner = owner
        super().__init__(f"refusing to install into {path}: mode {mode:o}, owner uid {owner}: "
                         "other users may write it, so they could replace what is written "
                         "there. Accepted: a directory only its owner can write (such as "
                         "0755), or a sticky one (such as 1777) owned by this user "
                         f"(uid {os.geteuid()})")


class CoreUnavailableError(NeuronmpError, RuntimeError):
    """Requested NeuronCores are held by another process.

    ``requested`` is the tuple of global cores asked for, or an int count;
    ``available`` how many cores were free; ``holders`` a tuple of
    ``(core, pid, command)`` for the cores in the way.
    """

    _fields = ("requested", "available", "holders", "detail")

    def __init__(self, requested, available: int, holders=(), detail: str = ""):
        self.requested = requested
        self.available = available
        self.holders = tuple(tuple(h) for h in holders)
        self.detail = detail
        req = str(requested) if isinstance(requested, int) else span(requested, "nc", pair=True)
        msg = f"NeuronCore(s) not available - Requested:{req} Available:{available}"
        by_pid = {}
        for core, pid, cmd in self.holders:
            by_pid.setdefault((pid, cmd), []).append(core)
        for (pid, cmd), cores in sorted(by_pid.items(), key=lambda kv: kv[1][0]):
            names = span(cores, "nc")
            msg += f"; {names} held by pid {pid} ({cmd})"
        if detail:
            msg += f"; {detail}"
        super().__init__(msg)


# -- transport and workers ------------------------------------------------------


class PeerDiedError(NeuronmpError, ConnectionError):
    """The process at the other end of a ring is gone."""

    _fields = ("pid", "detail")

    def __init__(self, pid: int, detail: str = ""):
        self.pid = pid
        self.detail = detail
        super().__init__(f"peer process {pid} died" + (f": {detail}" if detail else ""))


class ShmSpaceError(NeuronmpError, OSError):
    """Not enough shared memory to reserve a segment up front."""

    _fields = ("path", "requested", "free")

    def __init__(self, path: str, requested: int, free: int):
        self.path = path
        self.requested = requested
        self.free = free
        import errno

        super().__init__(
            errno.ENOSPC,
            f"No space to reserve {requested} bytes of shared memory in {path} "
            f"({free} bytes free)",
        )

    def __str__(self):
        return self.args[1]


class WorkerDiedError(NeuronmpError, RuntimeError):
    """The worker process serving a NeuronCore died while it held a request."""

    _fields = ("core", "pid", "exitcode")

    def __init__(self, core: int, pid: int, exitcode: Optional[int]):
        self.core = core
        self.pid = pid
        self.exitcode = exitcode
        how = describe_exit(exitcode)
        super().__init__(f"worker for NeuronCore {core} (pid {pid}) died: {how}")


class WorkerPackageError(NeuronmpError, ImportError):
    """A worker runs another copy of neuronmp than its coordinator.

    Python 3.11's forkserver imports the preloaded worker module with the current
    directory first on its path (it ignores the coordinator's ``sys.path``), so a
    process started from inside another checkout gets that checkout's workers.
    """

    _fields = ("core", "ours", "theirs")

    def __init__(self, core: int, ours: str, theirs: str):
        self.core = core
        self.ours = ours
        self.theirs = theirs
        super().__init__(
            f"the worker for NeuronCore {core} runs neuronmp from {theirs}, this process "
            f"from {ours}: the forkserver imported it from the current directory; "
            "start the program from a directory without another copy of neuronmp")


class ExecTimeoutError(NeuronmpError, TimeoutError):
    """A model call ran past NEURON_RT_EXEC_TIMEOUT; its worker was killed and replaced."""

    _fields = ("core", "model", "timeout")

    def __init__(self, core: int, model: int, timeout: float):
        self.core = core
        self.model = model
        self.timeout = timeout
        super().__init__(
            f"model {model} on NeuronCore {core} did not finish within {timeout:g} s "
            "(NEURON_RT_EXEC_TIMEOUT; 0 turns the bound off): its worker was stopped and "
            "replaced")


class WeightWriteError(NeuronmpError, RuntimeError):
    """A model wrote to its weights in forward while its cores share one copy of them.

    The cores of a model map one read-only copy of its parameters and buffers
    (``NEURONMP_SHARE_WEIGHTS``): a write lands on a private copy of the written
    pages, the call fails with this error, and the core's weights are restored
    before its next request.  ``tensors`` names what was written, as the traced
    module names its parameters and buffers.
    """

    _fields = ("core", "model", "module", "tensors")

    def __init__(self, core: int, model: int, module: str, tensors: Sequence[str]):
        self.core = core
        self.model = model
        self.module = module
        self.tensors = tuple(tensors)
        written = ", ".join(self.tensors) or "a shared weight"
        super().__init__(
            f"model {model} ({module}) on NeuronCore {core} wrote to its weights in forward "
            f"({written}); the cores of a model share one read-only copy of its parameters "
            "and buffers, so the call is refused and the core's copy restored. Keep state "
            "out of the traced weights, or set NEURONMP_SHARE_WEIGHTS=0 to give each core "
            "a private, writable copy")


class BatchBucketsError(NeuronmpError, ValueError):
    """A list of batch buckets (``neuronmp.trace(batch_buckets=...)``, the serve config's
    ``batch_buckets`` parameter) that cannot be compiled: it must be a non-empty,
    strictly increasing sequence of batch sizes >= 1 holding the traced batch size."""

    _fields = ("buckets", "reason", "where")

    def __init__(self, buckets: Any, reason: str, where: str = "neuronmp.trace"):
        self.buckets = buckets
        self.reason = reason
        self.where = where
        super().__init__(
            f"{where}: batch_buckets={buckets!r} {reason}; accepted: a non-empty, strictly "
            "increasing sequence of batch sizes >= 1 that includes the example inputs' "
            "batch size (dim 0), e.g. (1, 4, 8, 16, 32)"
        )


class ModelError(NeuronmpError, RuntimeError):
    """A model raised on a NeuronCore.

    A RuntimeError, as the same traced model raises in process (TorchScript turns
    every error into one).  The message starts with the root error's own line (not
    the TorchScript frames around it) and names the core; the worker's formatted
    traceback is the ``__cause__``, as concurrent.futures does for a process pool.
    """

    _fields = ("core", "exc_type", "message", "traceback")

    def __init__(self, core: int, exc_type: str, message: str, traceback: str = ""):
        self.core = core
        self.exc_type = exc_type
        self.message = message
        self.traceback = traceback
        root_type, root = _root_error(exc_type, message)
        super().__init__(f"{root_type}: {root}\n(raised by the model on NeuronCore {core})")
        if traceback:
            self.__cause__ = RemoteTraceback(traceback)


class RemoteTraceback(Exception):
    """The traceback text of an error raised in a worker process."""

    def __init__(self, tb: str):
        self.tb = tb
        super().__init__(tb)

    def __str__(self):
        return f"\n\"\"\"\n{self.tb.rstrip()}\n\"\"\""


_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)): (.*)$")


def _root_error(exc_type: str, message: str):
    """(type, message) of the innermost error a TorchScript message wraps: its text
    ends with the original ``SomeError: what went wrong`` after the script frames."""
    lines = message.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        found = _ERROR_LINE.match(lines[i].strip())
        if found:
            rest = [found.group(2), *lines[i + 1:]]
            return found.group(1).rsplit(".", 1)[-1], "\n".join(rest).strip()
    return exc_type, message.strip()


class PoolClosedError(NeuronmpError, RuntimeError):
    """A request was made after the runtime was shut down."""

    _fields = ("detail",)

    def __init__(self, detail: str = "the neuronmp runtime is shut down"):
        self.detail = detail
        super().__init__(detail)


# -- serving (neuronmp.batching) ---------------------------------------------------


class QueueFullError(NeuronmpError, RuntimeError):
    """A BatchingServer refused a request: ``max_queue_size`` requests already wait
    (at the request's priority level, when the server has ``priority_levels``)."""

    _fields = ("max_queue_size", "queued", "priority")

    def __init__(self, max_queue_size: int, queued: int, priority: Optional[int] = None):
        self.max_queue_size = max_queue_size
        self.queued = queued
        self.priority = priority
        level = "" if priority is None else f" at priority level {priority}"
        super().__init__(
            f"BatchingServer queue is full: {queued} request(s) waiting{level}, "
            f"max_queue_size={max_queue_size}; retry later, add clients' back-off, or raise "
            "max_queue_size"
        )


class RequestTimeoutError(NeuronmpError, TimeoutError):
    """A served request did not finish within its timeout (``stage``: where it was)."""

    _fields = ("timeout", "stage")

    def __init__(self, timeout: float, stage: str):
        self.timeout = timeout
        self.stage = stage
        super().__init__(f"request timed out after {timeout:g} s while {stage}")


class ServerClosedError(NeuronmpError, RuntimeError):
    """A BatchingServer was closed before (or while) handling a request."""

    _fields = ("detail",)

    def __init__(self, detail: str = "the BatchingServer is closed"):
        self.detail = detail
        super().__init__(detail)


# -- the command-line tools --------------------------------------------------------


class MonitorConfigError(NeuronmpError, ValueError):
    """A neuron-monitor configuration file (``neuronmp-monitor -c FILE``) that cannot
    be used: an unknown metric group, a bad period, a bad tag_filter regex, a field
    of the wrong type.  ``field`` is its path in the file (``neuron_runtimes[0].
    metrics[1].type``); the monitor exits 2 before it reports anything."""

    _fields = ("path", "field", "value", "reason", "accepted")

    def __init__(self, path: str, field: str, value: Any, reason: str, accepted: str):
        self.path = path
        self.field = field
        self.value = value
        self.reason = reason
        self.accepted = accepted
        super().__init__(f"{path}: {field} = {value!r}: {reason}. Accepted: {accepted}")


# -- collectives (the ``neuron`` process group) -------------------------------


class CollectiveRankDiedError(NeuronmpError, RuntimeError):
    """A rank of a ``neuron`` process group died while the others waited for it."""

    _fields = ("rank", "pid", "op")

    def __init__(self, rank: int, pid: int, op: str):
        self.rank = rank
        self.pid = pid
        self.op = op
        super().__init__(
            f"Rank {rank} (pid {pid}) of the neuron process group died during {op}; "
            "the collective cannot complete: restart the job")


class CollectiveTimeoutError(NeuronmpError, TimeoutError):
    """Ranks of a ``neuron`` process group did not reach a collective in time."""

    _fields = ("op", "missing", "timeout")

    def __init__(self, op: str, missing: Sequence[int], timeout: float):
        self.op = op
        self.missing = list(missing)
        self.timeout = timeout
        super().__init__(
            f"{op} timed out after {timeout:g} s waiting for rank(s) {self.missing} of the "
            "neuron process group (alive, but not calling the same collective); raise the "
            "timeout= of init_process_group or check that every rank calls it")


class CollectiveUsageError(NeuronmpError, ValueError):
    """A collective was called with arguments the ``neuron`` process group refuses."""

    _fields = ("op", "detail")

    def __init__(self, op: str, detail: str):
        self.op = op
        self.detail = detail
        super().__init__(f"{op}: {detail}")


class CollectiveOpError(CollectiveUsageError, RuntimeError):
    """A collective's arguments its op cannot handle (an empty tensor to reduce, an
    output of the wrong size): a RuntimeError, as TorchNeuron raises it, whose message
    begins as TorchNeuron's."""

    def __init__(self, op: str, detail: str):
        self.op = op
        self.detail = detail
        RuntimeError.__init__(self, f"No implementation could handle operation {op}. {detail}")


class CollectiveMismatchError(CollectiveUsageError, RuntimeError):
    """The ranks of a ``neuron`` process group met in a collective with calls that do
    not agree (another collective, element count, dtype, root or reduce op, or a rank
    that refused its own arguments): every rank raises it, with every rank's call.
    On Trainium the collective's execution fails then: its message begins as
    TorchNeuron's execution error of the op that runs it, a RuntimeError.

    ``sent``: per rank, a dict of op, numel, dtype, root, reduce_op and refused (the
    start of that rank's own error, or None); ``differ``: the ranks whose call is not
    the most common one."""

    _fields = ("op", "sent", "differ")

    def __init__(self, op: str, sent: Sequence[dict], differ: Sequence[int]):
        self.sent = [dict(s) for s in sent]
        self.differ = list(differ)
        calls = "; ".join(f"rank {r} {_call(s)}" for r, s in enumerate(self.sent))
        self.op = op
        self.detail = (f"the ranks' calls do not agree (rank(s) {self.differ} differ): "
                       f"{calls}; every rank must call the same collective with the same "
                       "element count, dtype, root and reduce op")
        RuntimeError.__init__(self, "NRT Execution error occurred on Neuron for operation="
                                    f"{_RUNS_AS.get(op, op)}: {op}: {self.detail}")


#: the op TorchNeuron runs each collective as (reduce and broadcast are all_reduces)
_RUNS_AS = {"reduce": "all_reduce", "broadcast": "all_reduce",
            "all_reduce_coalesced": "all_reduce", "gather": "all_gather",
            "all_gather_into_tensor": "all_gather", "all_gather_coalesced": "all_gather",
            "scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
            "all_to_all_single": "all_to_all"}


def _call(sent: dict) -> str:
    if sent.get("refused") is not None:
        return f"refused its {sent['op']} ({sent['refused']})"
    what = [f"{sent['op']} of {sent['numel']} x {sent['dtype']}" if sent.get("dtype")
            else str(sent["op"])]
    if sent.get("root") is not None:
        what.append(f"root {sent['root']}")
    if sent.get("reduce_op") is not None:
        what.append(sent["reduce_op"])
    return ", ".join(what)
