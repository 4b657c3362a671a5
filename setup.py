"""Build script: the package itself is described in setup.cfg.

The compiled pieces are the ring transport's two C helpers (plain C, no
dependency beyond Python's headers and gcc), sharing neuronmp/ipc/_shm.h:
  neuronmp.ipc._waits   atomics, futex waits, the answer-slot flags
  neuronmp.ipc._frames  frame encode/decode and copies on shared mappings
"""
from setuptools import Extension, setup

_FLAGS = ["-O2", "-std=gnu11"]


def _ext(name: str) -> Extension:
    return Extension(f"neuronmp.ipc.{name}", [f"neuronmp/ipc/{name}.c"],
                     depends=["neuronmp/ipc/_shm.h"], extra_compile_args=_FLAGS)


setup(ext_modules=[_ext("_waits"), _ext("_frames")])
