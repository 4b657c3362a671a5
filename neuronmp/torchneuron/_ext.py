"""The ``neuron`` device's C++ extension: compiled on first use, cached per user.

    load()
      cache dir = $NEURONMP_TORCHNEURON_CACHE
                  or $XDG_CACHE_HOME/neuronmp/torchneuron (~/.cache/...)
                  / torch-<version>-py<major><minor>
      module name = neuronmp_neuron_<hash of the source and the torch build>
        .so there?  ─▶ imported directly (no build tool runs: cheap)
        else        ─▶ compiler check, one line on stderr, a lock across processes,
                       torch.utils.cpp_extension.load (ninja) into that directory

Never built at ``pip install`` time: pip's build isolation would fetch a torch
wheel (CUDA-sized) only to compile against it, and the extension must match the
torch this interpreter imports, which only the first use knows.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from types import ModuleType
from typing import Optional

import torch

from .. import settings
from .._flock import Flock
from ..errors import DeviceExtensionError

ENV_CACHE = "NEURONMP_TORCHNEURON_CACHE"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "neuron.cpp")
#: how long a process waits for another one compiling the same extension
BUILD_WAIT = 900.0

_lock = threading.Lock()
_module: Optional[ModuleType] = None


def cache_dir() -> str:
    """Where the compiled extension lives for this user and torch version."""
    base = settings.get("torchneuron_cache") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "neuronmp", "torchneuron")
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
    built = _import_built(where, name)
    if built is not None:
        return built
    _check_tools()
    os.makedirs(where, exist_ok=True)
    lock = Flock.acquire(os.path.join(where, f"{name}.lock"), timeout=BUILD_WAIT)
    if lock is None:
        raise DeviceExtensionError(
            "its C++ extension built", f"another process held {where}/{name}.lock for "
            f"{BUILD_WAIT:.0f} s while compiling it; remove the directory if none runs")
    try:
        built = _import_built(where, name)   # compiled by the process we waited for
        if built is not None:
            return built
        sys.stderr.write(f"neuronmp: compiling the neuron device's C++ extension once for "
                         f"torch {torch.__version__} into {where} (about a minute)\n")
        return _build(where, name)
    finally:
        lock.release()


def _import_built(where: str, name: str) -> Optional[ModuleType]:
    """The built module, if this cache has it (only a whole file is ever there: a
    build is renamed into place when it is done)."""
    path = os.path.join(where, f"{name}.so")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_tools() -> None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise DeviceExtensionError(
            "a C++ compiler", f"{compiler!r} is not on PATH; install one (e.g. "
            "'apt-get install g++' or 'dnf install gcc-c++'), or point CXX at it")
    if not cpp_extension.is_ninja_available():
        raise DeviceExtensionError(
            "the ninja build tool", "install it with 'pip install ninja' or your system's "
            "package manager")


def _build(where: str, name: str) -> ModuleType:
    from torch.utils import cpp_extension

    build = os.path.join(where, f"build-{name}")
    os.makedirs(build, exist_ok=True)
    try:
        module = cpp_extension.load(name, [SOURCE], build_directory=build,
                                    extra_cflags=["-O2"], verbose=False)
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as err:
        raise DeviceExtensionError(
            "its C++ extension compiled", f"{err} (build directory: {build})") from err
    staged = os.path.join(where, f"{name}.so.partial")
    shutil.copyfile(module.__file__, staged)
    os.replace(staged, os.path.join(where, f"{name}.so"))
    return module
