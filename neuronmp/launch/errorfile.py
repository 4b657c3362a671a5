"""Error files: how a rank tells its launcher why it failed.

Owns the ``@record`` decorator (rank side) and :func:`read_error_file`
(launcher side).  The file format is torchrun's, so a script decorated with
torch's own ``torch.distributed.elastic.multiprocessing.errors.record`` is
understood by neuronmp-run, and ours by torchrun:

    rank: @record main() raises
        |  writes $TORCHELASTIC_ERROR_FILE (set per rank by the launcher)
        v  {"message": {"message": "ValueError: boom",
        |               "extraInfo": {"py_callstack": "Traceback ...",
        |                             "timestamp": "1700000000"}}}
    launcher: read_error_file() -> ErrorRecord -> the failure summary

Imports no torch.
"""
from __future__ import annotations

import functools
import json
import os
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

from ..host import settings

ENV_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class ErrorRecord:
    """A rank's recorded exception: ``message`` is ``"Type: text"``."""

    message: str
    traceback: str = ""
    timestamp: Optional[float] = None


def record(fn: F) -> F:
    """Decorate a rank's entry point so an uncaught exception is written to its error file.

    The exception is re-raised afterwards, so the rank still exits non-zero
    with its traceback on stderr.  Without ``TORCHELASTIC_ERROR_FILE`` (not
    under a launcher) the decorator changes nothing.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            write_error_file(exc)
            raise

    return wrapper  # type: ignore[return-value]


def write_error_file(exc: BaseException, path: Optional[str] = None) -> Optional[str]:
    """Write ``exc`` to ``path`` (default: ``$TORCHELASTIC_ERROR_FILE``); returns the path."""
    path = path or settings.get("error_file")
    if not path:
        return None
    stack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    data = {"message": {
        "message": f"{type(exc).__name__}: {exc}",
        "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time()))},
    }}
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    # write then rename: the launcher may read the file the moment the rank dies
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
    return path


def read_error_file(path: str) -> Optional[ErrorRecord]:
    """The error a rank recorded at ``path``, or None if there is none or it is unreadable."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, str):  # older torchrun writers put a plain string here
        return ErrorRecord(message=message)
    if not isinstance(message, dict):
        return None
    extra = message.get("extraInfo") or {}
    try:
        stamp = float(extra.get("timestamp"))
    except (TypeError, ValueError):
        stamp = None
    return ErrorRecord(
        message=str(message.get("message", "")),
        traceback=str(extra.get("py_callstack", "")),
        timestamp=stamp,
    )
