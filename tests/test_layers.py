"""The package's structure: every import points down the layers docs/design.md draws.

Modules are listed lowest first, layer by layer; a module may import only modules
listed before it.  Every import counts: module-level, inside a function, under
``TYPE_CHECKING``, in an ``if __name__ == "__main__":`` block, and
``importlib.import_module`` of a literal name (a lazy import is still a dependency).
A C extension is a module like any other (found by its ``PyInit_``).

No doors: a caller imports a name from the module that defines it.  So no module
but the package root (the public SDK surface, whose names load lazily) and the
deprecated ``neuronmp.serve`` alias defines a module-level ``__getattr__``, no
module keeps a table naming modules of another layer to load names from, and no
internal module (below the API) lists in ``__all__`` a name it imported from another
layer.  The API and everything above it are surfaces users import from (the SDK's
names, the torch_neuronx stand-ins, the batching server's errors): their ``__all__``
gathers names on purpose.
"""
from __future__ import annotations

import ast
import pathlib
import re
import shutil

import pytest

import neuronmp

ROOT = pathlib.Path(neuronmp.__file__).parent

#: the layers, lowest first, each lowest module first
LAYERS = {
    # torch-free: this process's cores and the files guarding them
    "host": ["host.spans", "host.supervise", "errors", "host.envconfig", "host.devicetime",
             "host.topology", "host.visibility", "host.settings", "host.procid", "host.flock",
             "host.paths", "host.leftovers", "host.liveness", "host.reservation",
             "host.runtime", "host._torchscript", "host"],
    # torch-free: segments and the C primitives on shared mappings
    "shm": ["shm.segment", "shm._waits", "shm._guard", "shm"],
    "ipc": ["ipc._frames", "ipc.codec", "ipc.ring", "ipc"],
    "pool": ["pool.protocol", "pool.limits", "pool.stats", "pool.archive", "pool.weights",
             "pool.shelf", "pool.answer", "pool.worker", "pool.workerproc", "pool.pacing",
             "pool.supervisor", "pool.channel", "pool.coordinator", "pool.loopchannel", "pool"],
    "session": ["session.coreuse", "session.session", "session.pytree", "session.sdkargs",
                "session._rowcut", "session.chunking", "session.model", "session"],
    "api": ["ops", "tracing", "placement", "parallel", "experimental", "loading", "analysis",
            "batching.config", "batching.lock", "batching.queue", "batching.rowbytes",
            "batching.rows",
            "batching.threads", "batching.loop", "batching.server", "batching"],
    "entry": ["launch.errorfile", "launch.launcher", "launch", "cli", "server.errors",
              "server._front",
              "server.config", "server.shm", "server.document", "server.models",
              "server.metrics", "server.infer", "server.routes", "server.wire", "server.app",
              "server.front",
              "server.grpc_service", "server.__main__", "server", "serve.__main__", "serve"],
    "torchneuron": ["torchneuron._ext", "torchneuron.coverage", "torchneuron.rnn",
                    "torchneuron.attention", "torchneuron.device",
                    "torchneuron.optrack", "torchneuron.syncbn", "torchneuron.sharding",
                    "torchneuron.collectives.calls",
                    "torchneuron.collectives.checks",
                    "torchneuron.collectives.arrivals",
                    "torchneuron.collectives.peermem", "torchneuron.collectives._pieces",
                    "torchneuron.collectives.pieces", "torchneuron.collectives.shm",
                    "torchneuron.collectives.group", "torchneuron.collectives", "torchneuron",
                    "torchneuron.backend"],
    "top": ["provide", "pytest_plugin", "__main__"],
}
ORDER = [module for layer in LAYERS.values() for module in layer]

#: the only modules that may answer attribute lookups with a module-level __getattr__
_LAZY_ALLOWED = {"", "serve"}
#: the layers no user imports from: their __all__ names only their own
_INTERNAL = ("host", "shm", "ipc", "pool", "session")


def _placed(module: str, order):
    """The entry of ``order`` for ``module`` (or for the first listed package holding it)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in order:
            return name
    return None


def _rank(module: str, order=ORDER) -> int:
    name = _placed(module, order)
    if name is None:
        raise AssertionError(f"neuronmp.{module} is not placed in a layer: add it to ORDER")
    return order.index(name)


def _layer_of(module: str) -> str:
    name = _placed(module, ORDER)
    return next((layer for layer, names in LAYERS.items() if name in names), "")


def _modules(root: pathlib.Path):
    """(dotted name below the package, path) of every module: .py files and C extensions."""
    for path in sorted(root.rglob("*.py")) + sorted(root.rglob("*.c")):
        if path.suffix == ".c" and "PyInit_" not in path.read_text():
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _import_targets(module: str, path: pathlib.Path, known):
    """(line, module) for each import of a package module in ``path``, anywhere in it."""
    if path.suffix != ".py":
        return
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = [p for p in package if p]

    def absolute(level, name):
        if not level:
            return name[len("neuronmp."):] if name.startswith("neuronmp.") else \
                ("" if name == "neuronmp" else None)
        base = package[: len(package) - (level - 1)] if level > 1 else package
        return ".".join(base + ([name] if name else []))

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = absolute(node.level, node.module or "")
            if target is None:
                continue
            names = [target] + [f"{target}.{a.name}".strip(".") for a in node.names]
            for name in names:   # a name that is not a module is an attribute: skip it
                if name in known:
                    yield node.lineno, name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                target = absolute(0, alias.name)
                if target:
                    yield node.lineno, target
        elif isinstance(node, ast.Call) and _is_import_call(node) and node.args and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            name = node.args[0].value
            level = len(name) - len(name.lstrip("."))
            target = absolute(level, name.lstrip(".") if level else name)
            if target:
                yield node.lineno, target


def _is_import_call(node: ast.Call) -> bool:
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or \
        (isinstance(f, ast.Name) and f.id in ("import_module", "__import__"))


def upward_imports(root: pathlib.Path, order=ORDER):
    """Every import in the package under ``root`` that points up (or out of) the order."""
    modules = dict(_modules(root))
    found = []
    for module, path in modules.items():
        if not module:
            continue   # the package root: the SDK surface sits on top of everything
        own = _rank(module, order)
        for line, target in _import_targets(module, path, modules):
            if not target or target == module or target.startswith(module + "."):
                continue   # a package importing its own modules
            if module.startswith(target + "."):
                continue   # `from . import x`: the enclosing package is not a dependency
            if _placed(target, order) is None or _rank(target, order) > own:
                found.append(f"neuronmp/{path.relative_to(root)}:{line} imports {target}")
    return found


def _module_level(tree: ast.Module):
    """The statements run at import, descending into if/try/with blocks, not defs."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, field, []) or [])
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)


def _strings(node):
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and re.fullmatch(r"\.?[\w.]+", n.value)]


def doors(root: pathlib.Path):
    """Every re-export door in the package under ``root``: module-level ``__getattr__``
    outside the root and the serve alias, module tables naming another layer's modules,
    an internal module's ``__all__`` names imported from another layer."""
    modules = dict(_modules(root))
    found = []
    for module, path in modules.items():
        if path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text())
        where = f"neuronmp/{path.relative_to(root)}"
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        imported = {}
        for node in _module_level(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and \
                    module not in _LAZY_ALLOWED:
                found.append(f"{where}:{node.lineno} defines a module-level __getattr__")
            if isinstance(node, ast.ImportFrom):
                for line, target in _import_targets(module, path, modules):
                    if line == node.lineno:
                        for a in node.names:
                            imported[a.asname or a.name] = target
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and module and \
                    isinstance(node.value, (ast.Dict, ast.List, ast.Tuple, ast.Set)):
                for text in _strings(node.value):
                    name = text[len("neuronmp."):] if text.startswith("neuronmp.") else \
                        f"{package}.{text.lstrip('.')}".strip(".") if text.startswith(".") \
                        else text
                    if name in modules and _placed(name, ORDER) and \
                            _layer_of(name) != _layer_of(module) and "." in text:
                        found.append(f"{where}:{node.lineno} names {text} of another layer "
                                     "in a table")
        if _layer_of(module) not in _INTERNAL:
            continue   # a public surface: the package root, the API, the stand-ins
        for node in _module_level(tree):
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                for name in _strings(node.value):
                    source = imported.get(name)
                    if source and _placed(source, ORDER) and \
                            _layer_of(source) != _layer_of(module):
                        found.append(f"{where}:{node.lineno} re-exports {name} from "
                                     f"{source}")
    return found


def test_imports_only_point_down_the_layers():
    upward = upward_imports(ROOT)
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_every_module_is_placed_and_placed_once():
    assert len(ORDER) == len(set(ORDER))
    unplaced = [m for m, _ in _modules(ROOT) if m and _placed(m, ORDER) is None]
    assert not unplaced, f"add to LAYERS: {unplaced}"


def test_no_module_is_a_door_to_another():
    found = doors(ROOT)
    assert not found, "callers import names from the module defining them:\n" + \
        "\n".join(found)


def test_the_torch_free_layers_import_no_torch():
    torch_free = LAYERS["host"] + LAYERS["shm"] + ["pool.stats", "pool.protocol"]
    offenders = []
    for module, path in _modules(ROOT):
        if module not in torch_free or path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "torch" or n.startswith("torch.") for n in names):
                offenders.append(f"{module}:{node.lineno}")
    assert not offenders, offenders


@pytest.fixture
def copy(tmp_path):
    """A copy of the package's sources to plant faults in."""
    dst = tmp_path / "neuronmp"
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns("*.so", "__pycache__", "csrc"))
    return dst


def _plant(path: pathlib.Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def test_the_checker_passes_the_copy_and_reports_planted_upward_imports(copy):
    assert upward_imports(copy) == [] and doors(copy) == []
    _plant(copy / "host" / "runtime.py", "\n\ndef _late():\n    from ..session import model\n")
    _plant(copy / "shm" / "segment.py", "\nif __name__ == '__main__':\n"
                                         "    import neuronmp.pool.stats\n")
    _plant(copy / "ipc" / "ring.py", "\n\ndef _lazy():\n"
                                     "    return importlib.import_module('neuronmp.tracing')\n")
    found = upward_imports(copy)
    assert any(f.startswith("neuronmp/host/runtime.py:") and f.endswith("session.model")
               for f in found), found
    assert any(f.startswith("neuronmp/shm/segment.py:") and f.endswith("pool.stats")
               for f in found), found
    assert any(f.startswith("neuronmp/ipc/ring.py:") and f.endswith("tracing")
               for f in found), found
    assert len({f.split(" ")[0] for f in found}) == 3, found   # those lines, no others


def test_the_checker_reports_planted_doors(copy):
    _plant(copy / "session" / "session.py",
           "\n\n_DOOR = {'Segment': ('neuronmp.shm.segment', 'Segment')}\n\n\n"
           "def __getattr__(name):\n    raise AttributeError(name)\n")
    _plant(copy / "pool" / "__init__.py",
           "\nfrom ..shm.segment import Segment\n\n__all__ = ['Segment']\n")
    found = doors(copy)
    assert any("session/session.py" in f and "__getattr__" in f for f in found), found
    assert any("session/session.py" in f and "neuronmp.shm.segment" in f for f in found), found
    assert any("pool/__init__.py" in f and "re-exports Segment" in f for f in found), found
    assert len(found) == 3, found


def test_the_root_and_the_deprecated_alias_may_load_names_lazily(copy):
    # the two allowed: moving their __getattr__ elsewhere is what the checker refuses
    assert "def __getattr__" in (copy / "__init__.py").read_text()
    assert "def __getattr__" in (copy / "serve" / "__init__.py").read_text()
    (copy / "host" / "__init__.py").write_text((copy / "serve" / "__init__.py").read_text())
    assert [f for f in doors(copy) if "__getattr__" in f] == \
        [f for f in doors(copy) if f.startswith("neuronmp/host/__init__.py")]
    assert doors(copy)


def _c_includes(path: pathlib.Path):
    return re.findall(r'^#include\s+"([^"]+)"', path.read_text(), re.M)


def test_the_c_sources_include_only_down_the_layers():
    # C has no import statements to walk: the includes are its edges.  Shared memory's
    # sources include only each other; the transport's include each other and
    # shared memory's atomics (_shm.h); the request path's cutter includes only the
    # transport's row-range contract and its own copy of the describing source,
    # never the encoder's private header
    cutter = ROOT / "session" / "_rowcut.c"
    if not cutter.exists():
        pytest.skip("installed without the C sources")
    for path in sorted((ROOT / "shm").glob("*.[ch]")):
        for name in _c_includes(path):
            assert (ROOT / "shm" / name).exists() and "/" not in name, f"{path.name}: {name}"
    for path in sorted((ROOT / "ipc").glob("*.[ch]")):
        for name in _c_includes(path):
            assert name == "../shm/_shm.h" or "/" not in name and (ROOT / "ipc" / name).exists(), \
                f"{path.name} includes {name}"
    assert _c_includes(cutter) == ["../ipc/_tensor.h", "../ipc/_tensor.c"]


#: room sizes: the pool's rooms and the batching server's split by purpose
#: stay small enough to read; no module of the package grows past the second bound
_ROOM_MAX, _MODULE_MAX = 500, 700
_ROOMS = ("pool/*.py", "batching/*.py")


def test_rooms_stay_small_and_no_module_grows_past_the_bound():
    too_big = []
    for path in sorted(ROOT.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        rel = path.relative_to(ROOT)
        bound = _ROOM_MAX if any(rel.match(g) for g in _ROOMS) else _MODULE_MAX
        if lines >= bound:
            too_big.append(f"neuronmp/{rel}: {lines} lines (bound {bound})")
    assert not too_big, "split by purpose: " + "; ".join(too_big)
