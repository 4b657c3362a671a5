"""Build script: the package itself is described in setup.cfg.

The compiled pieces are plain C (no dependency beyond Python's headers and gcc).
Shared memory's, sharing neuronmp/shm/_shm.h (its atomics):
  neuronmp.shm._waits   atomics, futex waits, the answer-slot flags
  neuronmp.shm._guard   copies on client-owned mappings that survive a SIGBUS
the ring transport's, on top of them:
  neuronmp.ipc._frames  frame encode/decode and copies on shared mappings (the
                        sources neuronmp/ipc/_frames*.c, sharing _frames.h, and
                        neuronmp/ipc/_tensor.c, a tensor described)
and the request path's:
  neuronmp.session._rowcut  DataParallel's row cutter (neuronmp/session/_rowcut.c,
                        which compiles in its own copy of neuronmp/ipc/_tensor.c and
                        follows the row-range contract of neuronmp/ipc/_tensor.h)
  neuronmp.server._front  the HTTP front end's request scanner (one whole request
                        of the common binary-inference shape; see the source)
and the neuron process group's:
  neuronmp.torchneuron.collectives._pieces  an all_reduce's pieces, claimed and
                        reduced across every rank's mapped tensor

``_neuronmp_provide.pth`` goes to the top of site-packages, next to the
``_neuronmp_provide`` module it imports when NEURONMP_PROVIDE is set (the module
aliases, see that module): a wheel puts it there when it sits at the root of
build_lib; an editable install (PEP 660) writes build_lib to a throwaway
directory, so there it goes straight into the wheel being built.
"""
import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

_FLAGS = ["-O2", "-std=gnu11"]
_PTH = "_neuronmp_provide.pth"


# _frames is one extension built from several sources sharing _frames.h (see there)
_FRAMES_PARTS = ["encode", "decode", "ring", "copy"]


_TENSOR = ["neuronmp/ipc/_tensor.h", "neuronmp/ipc/_tensor.c"]


def _ext(package: str, name: str, parts=(), header=None, extra=()) -> Extension:
    where = f"neuronmp/{package}"
    sources = [f"{where}/{name}.c"] + [f"{where}/{name}_{p}.c" for p in parts]
    depends = ["neuronmp/shm/_shm.h"] + ([f"{where}/{header}"] if header else [])
    return Extension(f"neuronmp.{package}.{name}", sources + list(extra),
                     depends=depends + _TENSOR, extra_compile_args=_FLAGS)


# the cutter includes its copy of _tensor.c: no object file shared with _frames
_ROWCUT = Extension("neuronmp.session._rowcut", ["neuronmp/session/_rowcut.c"],
                    depends=_TENSOR, extra_compile_args=_FLAGS)


_FRONT = Extension("neuronmp.server._front", ["neuronmp/server/_front.c"],
                   extra_compile_args=_FLAGS)


# the all_reduce kernels: -O3 vectorises their loops (and builds their AVX clones)
_PIECES = Extension("neuronmp.torchneuron.collectives._pieces",
                    ["neuronmp/torchneuron/collectives/_pieces.c"],
                    depends=["neuronmp/shm/_shm.h"], extra_compile_args=["-O3", "-std=gnu11"])


class BuildPyWithPth(build_py):
    """build_py that also places the start-up hook's .pth file."""

    def run(self):
        super().run()
        self.copy_file(_PTH, os.path.join(self.build_lib, _PTH), preserve_mode=False)
        if getattr(self, "editable_mode", False):
            wheel_root = self.get_finalized_command("install").install_lib
            self.copy_file(_PTH, os.path.join(wheel_root, _PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, _PTH)]


setup(ext_modules=[_ext("shm", "_waits"), _ext("shm", "_guard"),
                   _ext("ipc", "_frames", _FRAMES_PARTS, "_frames.h", ["neuronmp/ipc/_tensor.c"]),
                   _ROWCUT, _FRONT, _PIECES],
      cmdclass={"build_py": BuildPyWithPth})
