"""The import hook behind ``NEURONMP_PROVIDE``: neuronmp stands in for Neuron SDK packages.

``_neuronmp_provide.pth`` (installed into site-packages with neuronmp) runs at every
interpreter start; it looks up ``NEURONMP_PROVIDE`` once and imports this module only
when the variable is set, so an unset variable costs one dictionary lookup.  Every
Python child (subprocess, multiprocessing spawn/forkserver, neuronmp-run, torchrun)
inherits the variable and so gets the hook too.

    NEURONMP_PROVIDE=torch_neuronx,torch_neuron
        install() appends a finder to the END of sys.meta_path:
        import torch_neuronx ─▶ every other finder first (a real torch-neuronx wins)
                              ─▶ else neuronmp/provide/torch_neuronx/ loaded AS torch_neuronx
                                 (a package: torch_neuronx.experimental is its submodule)
    NEURONMP_PROVIDE=torchneuron   (TorchNeuron, the native `neuron` device)
        import torch         ─▶ torch's "torch.backends" entry points ─▶ autoload_torch()
                                 registers the device (TORCH_DEVICE_BACKEND_AUTOLOAD=0: not)
        import torch_neuronx ─▶ neuronmp/provide/torchneuron/ loaded AS torch_neuronx
    Both torch_neuronx and torchneuron: one line on stderr; importing torch_neuronx (or
    torch with autoload) raises neuronmp.ProvideConflictError naming both.

A bad value does not break interpreter start-up: one line on stderr, and importing an
alias then raises ``neuronmp.ProvideError`` (an ImportError) naming the variable, the
value and the accepted names.  This module is a top-level one on purpose: importing
anything under ``neuronmp`` would run ``neuronmp/__init__`` (signal handlers, the torch
import hook) in every process that merely has the variable set.  It imports nothing
beyond the standard library until an alias is imported.
"""
from __future__ import annotations

import os
import sys

ENV = "NEURONMP_PROVIDE"
#: the names the variable accepts, each a package under neuronmp/provide/
ACCEPTED = ("torch_neuronx", "torch_neuron", "torchneuron")
#: the modules those packages are imported as
MODULES = ("torch_neuronx", "torch_neuron")
#: the native TorchNeuron stand-in, imported as torch_neuronx like the XLA-era one
NATIVE = "torchneuron"
_warned = None   # the bad value already reported on stderr


def parse(value: str):
    """``(names, unknown)`` of a NEURONMP_PROVIDE value (a comma list; blanks ignored)."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    return tuple(n for n in names if n in ACCEPTED), tuple(n for n in names if n not in ACCEPTED)


def install(value=None) -> bool:
    """Put the alias finder on ``sys.meta_path`` for ``value`` (default: the environment).

    Called by the .pth file at start-up, and by code that sets the variable in a
    running process (the pytest plugin's ``--neuron-provide``).  Returns whether a
    finder is now installed; a second call replaces the first one's settings.
    """
    value = os.environ.get(ENV, "") if value is None else value
    names, unknown = parse(value)
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, AliasFinder)]
    if not names and not unknown:
        return False
    sys.meta_path.append(AliasFinder(value, names, unknown))
    global _warned
    if (unknown or _conflict(names)) and value != _warned:
        # once per process: site may read the .pth twice (a venv's lib64 -> lib link)
        _warned = value
        sys.stderr.write(
            f"neuronmp: {ENV}={value!r} names unknown module(s) {', '.join(unknown)} "
            f"(accepted: {', '.join(ACCEPTED)}); importing {' or '.join(MODULES)} will "
            "fail until it is fixed\n" if unknown else
            f"neuronmp: {ENV}={value!r} asks for both torch_neuronx (XLA era) and "
            f"{NATIVE} (native TorchNeuron); importing torch_neuronx will fail until one "
            "is removed\n")
    return True


def _conflict(names) -> bool:
    return "torch_neuronx" in names and NATIVE in names


def wants_native(value=None) -> bool:
    """Whether the variable (default: the environment's) asks for the native device."""
    value = os.environ.get(ENV, "") if value is None else value
    return NATIVE in (n.strip() for n in value.split(","))


def autoload_torch() -> None:
    """torch's "torch.backends" entry point, run by every ``import torch`` unless
    TORCH_DEVICE_BACKEND_AUTOLOAD=0: registers the ``neuron`` device when the variable
    asks for it, else returns at once (one lookup: no cost for everyone else)."""
    value = os.environ.get(ENV, "")
    if not value or not wants_native(value):
        return
    names, unknown = parse(value)
    if _conflict(names):
        from neuronmp.errors import ProvideConflictError
        raise ProvideConflictError(ENV, value, ("torch_neuronx", NATIVE))
    from neuronmp.torchneuron import register
    register()


class AliasFinder:
    """Finds ``torch_neuronx`` / ``torch_neuron`` in neuronmp when nothing else does."""

    def __init__(self, value: str, names, unknown):
        self.value = value
        self.names = frozenset(names)
        self.unknown = tuple(unknown)

    def find_spec(self, name, path=None, target=None):
        if name not in MODULES:   # the common case: one set lookup
            return None
        if self._found_elsewhere(name, path, target):
            return None
        if self.unknown or (name == "torch_neuronx" and _conflict(self.names)):
            return _failing_spec(name, self)
        if name == "torch_neuronx" and NATIVE in self.names:
            return _alias_spec(name, NATIVE)
        if name not in self.names:
            return None
        return _alias_spec(name)

    def _found_elsewhere(self, name, path, target) -> bool:
        """Whether a finder after this one (finders before it have already said no)
        finds a real package of that name."""
        mine = sys.meta_path.index(self) if self in sys.meta_path else len(sys.meta_path)
        for finder in sys.meta_path[mine + 1:]:
            find = getattr(finder, "find_spec", None)
            if find is not None and find(name, path, target) is not None:
                return True
        return False

    def __repr__(self) -> str:
        return f"<neuronmp AliasFinder {ENV}={self.value!r}>"


def _alias_spec(name: str, folder: str = ""):
    """A spec loading neuronmp/provide/<folder or name>/__init__.py under the name ``name``."""
    import importlib.util

    home = importlib.util.find_spec("neuronmp")   # located, not imported
    if home is None or not home.submodule_search_locations:
        return None
    folder = os.path.join(list(home.submodule_search_locations)[0], "provide", folder or name)
    return importlib.util.spec_from_file_location(
        name, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])


def _failing_spec(name: str, finder: AliasFinder):
    import importlib.machinery

    return importlib.machinery.ModuleSpec(name, _FailingLoader(finder))


class _FailingLoader:
    """Loads nothing: raises the clear error for a bad NEURONMP_PROVIDE."""

    def __init__(self, finder: AliasFinder):
        self.finder = finder

    def create_module(self, spec):
        try:
            from neuronmp.errors import ProvideConflictError, ProvideError
        except ImportError:   # neuronmp itself is broken: say so plainly
            raise ImportError(f"Invalid {ENV}={self.finder.value!r}; accepted: "
                              f"{', '.join(ACCEPTED)}") from None
        if not self.finder.unknown:
            raise ProvideConflictError(ENV, self.finder.value, ("torch_neuronx", NATIVE))
        raise ProvideError(ENV, self.finder.value, self.finder.unknown, ACCEPTED)

    def exec_module(self, module):  # never reached: create_module raises
        raise AssertionError("unreachable")
