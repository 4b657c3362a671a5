"""What a finished run must not leave behind, found and cleared.

A run of neuronmp owns three kinds of resource outside its own memory: processes
(the pool's workers, launched ranks), core locks, and shared-memory segments, the
last two under its runtime directory.  The pytest plugin's ``neuron_host`` and the
project's own test fixtures check all three after every test with these helpers;
each check returns one line per leftover, in words a failing test can print.
"""
from __future__ import annotations

import fcntl
import os
import sys
from typing import List

from ..errors import ConfigError, RuntimeDirError
from . import paths

__all__ = ["HELPERS", "GRACE", "held_locks", "segments", "is_helper", "kill_tree",
           "shutdown_runtime"]

#: multiprocessing's long-lived helpers, shared by every test of a session (though
#: never their children): not a leak
HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")
#: seconds a process's children get to exit before they count as leaked
GRACE = 5.0


def held_locks(runtime_dir: str) -> List[str]:
    """A line per core lock some process still holds (``alloc.lock`` is only held
    while a reservation is being written, never across calls)."""
    cores = paths.cores_dir(runtime_dir, create=False)
    if cores is None:
        return []
    held = []
    for name in sorted(os.listdir(cores)):
        if not name.endswith(".lock") or name == "alloc.lock":
            continue
        fd = os.open(os.path.join(cores, name), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.append(f"core lock {name} still held")
        finally:
            os.close(fd)
    return held


def segments(runtime_dir: str) -> List[str]:
    """A line per shared-memory segment left in the runtime directory, or in its
    page-cache twin of shared weights (``NEURONMP_WEIGHTS_DIR``)."""
    lines = []
    for kind, find in (("shared-memory segment", paths.shm_dir),
                       ("shared-weight file", paths.page_cache_dir)):
        try:
            directory = find(runtime_dir, create=False)
        except (ConfigError, RuntimeDirError):  # a bad NEURONMP_WEIGHTS_DIR: never used
            continue
        if directory is not None:
            lines += [f"{kind} {name} left behind in {directory}"
                      for name in sorted(os.listdir(directory))]
    return lines


def is_helper(proc) -> bool:
    """Whether the psutil process is one of multiprocessing's shared :data:`HELPERS`."""
    try:
        cmd = " ".join(proc.cmdline())
    except Exception:  # gone, a zombie, or not ours to read: not a helper
        return False
    return any(h in cmd for h in HELPERS)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants, and reap them (within :data:`GRACE`)."""
    import psutil

    try:
        root = psutil.Process(pid)
        victims = root.children(recursive=True) + [root]
    except psutil.Error:
        return
    for p in victims:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(victims, timeout=GRACE)


def shutdown_runtime() -> List[str]:
    """Shut down this process's neuronmp runtime if it was imported; a line if the
    shutdown itself failed (a failing shutdown is a leak to report)."""
    shutdown = getattr(sys.modules.get("neuronmp.host.runtime"), "shutdown", None)
    if shutdown is None:
        return []
    try:
        shutdown()
    except Exception as exc:
        return [f"neuronmp.shutdown() raised {exc!r}"]
    return []
