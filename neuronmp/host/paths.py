"""The per-user runtime directory, where neuronmp keeps host-wide state.

    <runtime dir>/            mode 0700, owned by this user
        cores/nc<N>.lock      reservation lock of global core N (reservation.py)
        cores/nc<N>.holder    who holds it: pid, start time, host, command, cores
        cores/alloc.lock      held briefly while a process picks its cores
        shm/                  shared-memory ring and statistics segments (ipc/, pool/)

    <temp dir>/neuronmp-<uid>-<key>/   large shared weights, where tmpfs maps no huge
                                       pages (pool/weights.py): one per runtime dir

This module is the one place that knows where they are.  Writers create what
they need (:func:`runtime_dir`, :func:`cores_dir`, :func:`shm_dir`); readers such
as ``neuronmp-ls`` and ``neuronmp-top`` must never create anything, and ask for
the *existing* directories (:func:`existing_runtime_dir`, ``create=False``),
which are None when absent and checked like the others when present.

``NEURONMP_WEIGHTS_DIR`` says where shared weights live: ``auto`` (the default:
``shm/``, or the runtime directory's page-cache twin on the temp filesystem for
large weights when only that one maps them with huge pages), ``shm``, or an
absolute path.  The twin is named for the runtime directory, so every reader of
a runtime directory (sweeps, leak checks, ``tidy``) finds it.

``NEURONMP_RUNTIME_DIR`` chooses it; by default it sits on /dev/shm (tmpfs,
so ring segments are real shared memory), else under $XDG_RUNTIME_DIR.  A
directory owned by someone else or writable by others is refused: whoever can
write there could forge holders or swap ring segments under us.  The last
process to give its cores back removes the directory (``reservation.tidy``).
"""
from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from typing import Optional

from ..errors import RuntimeDirError
from . import settings
from .settings import WEIGHTS_AUTO, WEIGHTS_SHM

ENV_RUNTIME_DIR = "NEURONMP_RUNTIME_DIR"
CORES = "cores"
SHM = "shm"


def default_runtime_dir() -> str:
    uid = os.getuid()
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return f"/dev/shm/neuronmp-{uid}"
    xdg = settings.get("xdg_runtime_dir")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "neuronmp")
    return f"/tmp/neuronmp-{uid}"


def configured_runtime_dir() -> str:
    """Where the runtime directory is to be, whether or not it exists (not checked)."""
    return settings.get("runtime_dir") or default_runtime_dir()


def runtime_dir(create: bool = True, path: Optional[str] = None) -> str:
    """The checked runtime directory (created mode 0700 when missing)."""
    path = os.path.abspath(path) if path else configured_runtime_dir()
    if create:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise RuntimeDirError(path, f"cannot create it ({exc.strerror})") from exc
    check_dir(path)
    return path


def check_dir(path: str, what: str = "runtime directory") -> None:
    """Refuse a directory that is not ours alone (``what`` names it in the error)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise RuntimeDirError(path, "it does not exist", what) from None
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(path, "it is not a directory", what)
    reason = not_ours_alone(st)
    if reason:
        raise RuntimeDirError(path, reason, what)


def not_ours_alone(st: os.stat_result, expected: str = "700") -> Optional[str]:
    """Why a file or directory with status ``st`` is not this user's alone (owned by
    someone else, or writable by group or others), or None when it is; ``expected``
    names the modes accepted, for the message."""
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by others (mode {stat.S_IMODE(st.st_mode):o}; expected {expected})"
    return None


def existing_runtime_dir() -> Optional[str]:
    """The checked runtime directory if it exists, else None; never creates it."""
    path = configured_runtime_dir()
    if not os.path.lexists(path):  # lexists: a dangling symlink is refused, not ignored
        return None
    check_dir(path)
    return path


def subdir(name: str, base: Optional[str] = None) -> str:
    """A private subdirectory of the runtime directory, created on demand."""
    path = os.path.join(base or runtime_dir(), name)
    os.makedirs(path, mode=0o700, exist_ok=True)
    check_dir(path)
    return path


def existing_subdir(name: str, base: Optional[str] = None) -> Optional[str]:
    """The checked subdirectory ``name`` if it exists, else None; never creates it."""
    root = base or existing_runtime_dir()
    if root is None:
        return None
    path = os.path.join(root, name)
    if not os.path.lexists(path):  # never made, or tidied away: it holds nothing
        return None
    check_dir(root)
    check_dir(path)
    return path


def cores_dir(base: Optional[str] = None, create: bool = True) -> Optional[str]:
    """``<runtime dir>/cores``, the reservation locks; None if absent and not ``create``."""
    return subdir(CORES, base) if create else existing_subdir(CORES, base)


def shm_dir(base: Optional[str] = None, create: bool = True) -> Optional[str]:
    """``<runtime dir>/shm``, the shared-memory segments; None if absent and not ``create``."""
    return subdir(SHM, base) if create else existing_subdir(SHM, base)


def weights_setting() -> str:
    """``NEURONMP_WEIGHTS_DIR``: ``"auto"`` (unset or empty), ``"shm"``, or a normalized
    absolute path; anything else is a ConfigError naming the value."""
    return settings.get("weights_dir")


def page_cache_dir(base: Optional[str] = None, create: bool = True) -> Optional[str]:
    """Where the shared weights of runtime directory ``base`` go off tmpfs: the path
    ``NEURONMP_WEIGHTS_DIR`` names, else ``<temp dir>/neuronmp-<uid>-<key of base>``.
    None under ``NEURONMP_WEIGHTS_DIR=shm``, or when absent and not ``create``; checked
    like the runtime directory (ours alone).  A named directory that fails the check
    is a RuntimeDirError; the automatic one is then None (someone else's in a shared
    /tmp, or a temp filesystem we cannot write: tmpfs serves instead)."""
    setting = weights_setting()
    if setting == WEIGHTS_SHM:
        return None
    if setting != WEIGHTS_AUTO:
        return _weights_dir(setting, create)
    root = os.path.realpath(base or configured_runtime_dir())
    key = hashlib.sha256(root.encode()).hexdigest()[:12]
    try:
        return _weights_dir(os.path.join(_temp_root(), f"neuronmp-{os.getuid()}-{key}"),
                            create)
    except RuntimeDirError:
        return None


def _weights_dir(path: str, create: bool) -> Optional[str]:
    what = "shared-weights directory"
    if create:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise RuntimeDirError(path, f"cannot create it ({exc.strerror})", what) from exc
    elif not os.path.lexists(path):
        return None
    check_dir(path, what)
    return path


def _temp_root() -> str:
    # tempfile.gettempdir() caches its first answer; the temp_dirs setting is live, so
    # a process that changes TMPDIR (a test fixture) moves its twins with it
    for value in settings.get("temp_dirs"):
        if os.path.isdir(value):
            return value
    return tempfile.gettempdir()
