"""The per-user runtime directory, where neuronmp keeps host-wide state.

    <runtime dir>/            mode 0700, owned by this user
        cores/nc<N>.lock      reservation lock of global core N (reservation.py)
        cores/nc<N>.holder    who holds it: pid, start time, host, command
        cores/alloc.lock      held briefly while a process picks its cores
        shm/                  shared-memory ring and statistics segments (ipc/, pool/)

``NEURONMP_RUNTIME_DIR`` chooses it; by default it sits on /dev/shm (tmpfs,
so ring segments are real shared memory), else under $XDG_RUNTIME_DIR.  A
directory owned by someone else or writable by others is refused: whoever can
write there could forge holders or swap ring segments under us.  The last
process to give its cores back removes the directory (``reservation.tidy``).
"""
from __future__ import annotations

import os
import stat
from typing import Optional

from .errors import RuntimeDirError

ENV_RUNTIME_DIR = "NEURONMP_RUNTIME_DIR"


def default_runtime_dir() -> str:
    uid = os.getuid()
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return f"/dev/shm/neuronmp-{uid}"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "neuronmp")
    return f"/tmp/neuronmp-{uid}"


def runtime_dir(create: bool = True, path: Optional[str] = None) -> str:
    """The checked runtime directory (created mode 0700 when missing)."""
    path = path or os.environ.get(ENV_RUNTIME_DIR) or default_runtime_dir()
    path = os.path.abspath(path)
    if create:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise RuntimeDirError(path, f"cannot create it ({exc.strerror})") from exc
    check_dir(path)
    return path


def check_dir(path: str) -> None:
    """Refuse a directory that is not ours alone."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise RuntimeDirError(path, "it does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(path, "it is not a directory")
    if st.st_uid != os.getuid():
        raise RuntimeDirError(
            path, f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeDirError(
            path, f"it is writable by others (mode {stat.S_IMODE(st.st_mode):o}; expected 700)"
        )


def subdir(name: str, base: Optional[str] = None) -> str:
    """A private subdirectory of the runtime directory, created on demand."""
    path = os.path.join(base or runtime_dir(), name)
    os.makedirs(path, mode=0o700, exist_ok=True)
    check_dir(path)
    return path
