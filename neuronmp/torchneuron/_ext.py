"""The ``neuron`` device's C++ extension: compiled on first use, cached per user.

    load()
      cache dir = $NEURONMP_TORCHNEURON_CACHE
                  or $XDG_CACHE_HOME/neuronmp/torchneuron (~/.cache/...)
                  / torch-<version>-py<major><minor>
      module name = neuronmp_neuron_<hash of the source and the torch build>
        .so there?  ─▶ checked (owner, mode, no symlink), then imported
                       directly (no build tool runs: cheap)
        else        ─▶ compiler check, one line on stderr, a lock across processes,
                       torch.utils.cpp_extension.load (ninja) into that directory

The cache is trusted only when it is this user's alone: both directories and the
library must be owned by this user and writable by no one else, and no symlink is
followed there (ExtensionCacheError otherwise, naming the variable and the path).
The library is checked and loaded through one descriptor, and a build is staged in
a fresh ``mkstemp`` file renamed over the name.

Never built at ``pip install`` time: pip's build isolation would fetch a torch
wheel (CUDA-sized) only to compile against it, and the extension must match the
torch this interpreter imports, which only the first use knows.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from types import ModuleType
from typing import Optional

import torch

from ..errors import DeviceExtensionError, ExtensionCacheError
from ..host import paths, settings
from ..host.flock import Flock

ENV_CACHE = "NEURONMP_TORCHNEURON_CACHE"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "neuron.cpp")
#: how long a process waits for another one compiling the same extension
BUILD_WAIT = 900.0
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: O_NONBLOCK: a FIFO under the library's name must not block the open
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK

_lock = threading.Lock()
_module: Optional[ModuleType] = None


def cache_dir() -> str:
    """Where the compiled extension lives for this user and torch version."""
    base = settings.get("torchneuron_cache") or os.path.join(
        settings.get("cache_home"), "neuronmp", "torchneuron")
    tag = f"torch-{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    return os.path.join(base, tag)


def module_name() -> str:
    """The extension's module name: changes with its source and the torch build."""
    h = hashlib.sha256()
    folder = os.path.dirname(SOURCE)
    for part in sorted(os.listdir(folder)):   # the source and the headers it includes
        if part.endswith((".cpp", ".h")):
            with open(os.path.join(folder, part), "rb") as f:
                h.update(part.encode() + b"\0" + f.read())
    h.update(torch.__version__.encode())
    h.update(str(torch._C._GLIBCXX_USE_CXX11_ABI).encode())
    return f"neuronmp_neuron_{h.hexdigest()[:12]}"


def load() -> ModuleType:
    """The extension module, compiling it first if this user has not yet."""
    global _module
    with _lock:
        if _module is None:
            _module = _load()
        return _module


def _load() -> ModuleType:
    where, name = cache_dir(), module_name()
    fd = _open_cache(where)
    try:
        return _load_in(fd, where, name)
    finally:
        os.close(fd)


def _load_in(fd: int, where: str, name: str) -> ModuleType:
    built = _import_built(fd, where, name)
    if built is not None:
        return built
    _check_tools()
    lock = Flock.acquire(os.path.join(where, f"{name}.lock"), timeout=BUILD_WAIT)
    if lock is None:
        raise DeviceExtensionError(
            "its C++ extension built", f"another process held {where}/{name}.lock for "
            f"{BUILD_WAIT:.0f} s while compiling it; remove the directory if none runs")
    try:
        built = _import_built(fd, where, name)   # compiled by the process we waited for
        if built is not None:
            return built
        sys.stderr.write(f"neuronmp: compiling the neuron device's C++ extension once for "
                         f"torch {torch.__version__} into {where} (about a minute)\n")
        return _build(fd, where, name)
    finally:
        lock.release()


def _open_cache(where: str) -> int:
    """A descriptor of the per-torch cache directory, made (mode 700) when missing, once
    it and the directory above it are found to be this user's alone.  Whoever else could
    write either could plant the library the next process loads.  Each is opened
    without following a symlink and checked through its descriptor, and the inner one
    is opened relative to the outer, so neither can be swapped after its check."""
    base = os.path.dirname(where)
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
    except FileExistsError:
        raise ExtensionCacheError(base, "it is not a directory") from None
    except OSError as exc:
        raise ExtensionCacheError(base, f"cannot create it ({exc.strerror})") from exc
    outer = _open_private(base, None)
    try:
        try:
            os.mkdir(os.path.basename(where), 0o700, dir_fd=outer)
        except FileExistsError:
            pass
        except OSError as exc:
            raise ExtensionCacheError(where, f"cannot create it ({exc.strerror})") from exc
        return _open_private(where, outer)
    finally:
        os.close(outer)


def _open_private(path: str, parent: Optional[int]) -> int:
    """``path`` (relative to the descriptor ``parent`` when given) opened as a directory,
    refused unless it is this user's alone."""
    try:
        fd = os.open(os.path.basename(path) if parent is not None else path, _DIR_FLAGS,
                     dir_fd=parent)
    except OSError as exc:
        raise ExtensionCacheError(path, _open_refusal(exc, "directory")) from None
    reason = paths.not_ours_alone(os.fstat(fd), "700 or 755")
    if reason:
        os.close(fd)
        raise ExtensionCacheError(path, reason)
    return fd


def _open_refusal(exc: OSError, kind: str) -> str:
    if exc.errno == errno.ELOOP:
        return "it is a symbolic link"
    if exc.errno == errno.ENOTDIR:
        return f"it is not a {kind}"
    return f"cannot open it ({exc.strerror})"


def _import_built(where_fd: int, where: str, name: str) -> Optional[ModuleType]:
    """The built module, if this cache has it (only a whole file is ever there: a
    build is renamed into place when it is done).  The file is opened without
    following a symlink, checked through its descriptor (a regular file, this user's,
    writable by no one else) and loaded through that same descriptor, so what is
    loaded is what was checked."""
    path = os.path.join(where, f"{name}.so")
    try:
        fd = os.open(f"{name}.so", _FILE_FLAGS, dir_fd=where_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ExtensionCacheError(path, _open_refusal(exc, "file")) from None
    try:
        st = os.fstat(fd)
        reason = ("it is not a regular file" if not stat.S_ISREG(st.st_mode)
                  else paths.not_ours_alone(st, "644 or 755"))
        if reason:
            raise ExtensionCacheError(path, reason)
        pinned = f"/proc/self/fd/{fd}"
        origin = pinned if os.path.exists(pinned) else path
        loader = importlib.machinery.ExtensionFileLoader(name, origin)
        spec = importlib.util.spec_from_file_location(name, origin, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    finally:
        os.close(fd)
    module.__file__ = path   # the descriptor's name means nothing once it is closed
    return module


def _check_tools() -> None:
    from torch.utils import cpp_extension

    # torch's cpp_extension runs the same CXX
    compiler = settings.get("cxx")
    if shutil.which(compiler) is None:
        raise DeviceExtensionError(
            "a C++ compiler", f"{compiler!r} is not on PATH; install one (e.g. "
            "'apt-get install g++' or 'dnf install gcc-c++'), or point CXX at it")
    if not cpp_extension.is_ninja_available():
        raise DeviceExtensionError(
            "the ninja build tool", "install it with 'pip install ninja' or your system's "
            "package manager")


def _build(where_fd: int, where: str, name: str) -> ModuleType:
    from torch.utils import cpp_extension

    build = os.path.join(where, f"build-{name}")
    try:
        os.mkdir(os.path.basename(build), 0o700, dir_fd=where_fd)
    except FileExistsError:
        pass
    os.close(_open_private(build, where_fd))   # ninja writes there: checked like its parent
    try:
        module = cpp_extension.load(name, [SOURCE], build_directory=build,
                                    extra_cflags=["-O2"], verbose=False)
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as err:
        raise DeviceExtensionError(
            "its C++ extension compiled", f"{err} (build directory: {build})") from err
    _install(where_fd, where, name, module.__file__)
    return module


def _install(where_fd: int, where: str, name: str, built: str) -> None:
    """Copy the library ninja built to ``<name>.so``: staged in a fresh file of its own
    (mkstemp: never an existing name, never through a symlink), then renamed over the
    name, so a reader finds the whole file or none, and nothing planted under the
    staging name is written through."""
    fd, staged = tempfile.mkstemp(prefix=f".{name}.", suffix=".so.partial", dir=where)
    try:
        with os.fdopen(fd, "wb") as dst, open(os.open(built, _FILE_FLAGS), "rb") as src:
            shutil.copyfileobj(src, dst)
            os.fchmod(dst.fileno(), 0o755)
        os.replace(os.path.basename(staged), f"{name}.so", src_dir_fd=where_fd,
                   dst_dir_fd=where_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise
