"""Build script: the package itself is described in setup.cfg.

The one compiled piece is neuronmp.ipc._sync, the ring transport's atomics and
futex helper (plain C, no dependency beyond Python's headers and gcc).
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "neuronmp.ipc._sync",
            ["neuronmp/ipc/_sync.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
        )
    ],
)
