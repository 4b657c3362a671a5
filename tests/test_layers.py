"""The package's structure: every import points down the layers docs/design.md draws.

Modules are listed lowest first; a module may import only modules listed before it
(function-level imports included: a lazy import is still a dependency, and so is
an import in a module's ``if __name__ == "__main__":`` block).  The API layer and
everything above it reach the pool and the transport only through the session
and the model (``session``, ``model``, ``coreuse``, ``chunking``): they may not
skip down to ``pool`` or ``ipc``.
"""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

import neuronmp

ROOT = pathlib.Path(neuronmp.__file__).parent

ORDER = [
    # runtime layer: torch-free
    "spans", "supervise", "errors", "envconfig", "devicetime", "topology", "visibility",
    "settings", "procid", "_flock", "paths", "leftovers",
    "liveness", "reservation", "runtime", "_torchscript",
    # transport
    "ipc.segment", "ipc.codec", "ipc.ring", "ipc",
    # pool
    "pool.protocol", "pool.limits", "pool.stats", "pool.archive", "pool.weights", "pool.shelf",
    "pool.answer", "pool.worker", "pool.workerproc", "pool.pacing", "pool.supervisor",
    "pool.channel", "pool.coordinator", "pool.loopchannel", "pool",
    # session and the request path
    "coreuse", "session", "pytree", "_sdkargs", "chunking", "model",
    # API
    "ops", "tracing", "placement", "parallel", "experimental", "loading", "analysis",
    "batchconfig", "batchpolicy", "batchbytes", "batchrows", "batchlanes", "batchloop", "batching",
    # entry points
    "launch.errorfile", "launch.launcher", "launch", "cli", "server.config", "server.shm",
    "server.document", "server.models", "server.metrics", "server.infer", "server.routes",
    "server.wire",
    "server.app",
    "server.front",
    "server.grpc_service", "server.__main__", "server", "serve.__main__", "serve",
    "torchneuron._ext", "torchneuron.coverage", "torchneuron.rnn", "torchneuron.attention",
    "torchneuron.syncbn", "torchneuron.device", "torchneuron.optrack",
    "torchneuron.collectives.calls", "torchneuron.collectives.peermem",
    "torchneuron.collectives.shm",
    "torchneuron.collectives.group", "torchneuron.collectives", "torchneuron",
    "torchneuron.backend",
    "provide", "pytest_plugin", "__main__",
]


def _rank(module: str) -> int:
    """The position of ``module`` (or of the first listed package containing it)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in ORDER:
            return ORDER.index(name)
    raise AssertionError(f"neuronmp.{module} is not placed in a layer: add it to ORDER")


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            yield ".".join(parts), path


def _imports(module: str, path: pathlib.Path):
    package = module.split(".")[:-1] if not path.name == "__init__.py" else module.split(".")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] + [f"{target}.{a.name}".strip(".") for a in node.names]
            elif (node.module or "").startswith("neuronmp."):
                target = node.module[len("neuronmp."):]
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:   # a name that is not a module is an attribute: skip it
                if name.strip(".") in _KNOWN:
                    yield node.lineno, name.strip(".")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("neuronmp."):
                    yield node.lineno, alias.name[len("neuronmp."):]


_KNOWN = {name for name, _ in _modules()}


def test_imports_only_point_down_the_layers():
    upward = []
    for module, path in _modules():
        own = _rank(module)
        for line, target in _imports(module, path):
            if not target or target.split(".")[0] in ("neuronmp",):
                continue
            if target == module or target.startswith(module + "."):
                continue   # a package importing its own modules
            if module.startswith(target + "."):
                continue   # `from . import x`: the enclosing package is not a dependency
            if _rank(target) > own:
                upward.append(f"neuronmp/{path.relative_to(ROOT)}:{line} imports {target}")
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


#: the first module of the API layer: it and every module above it may not import these
_API = "ops"
_BELOW_THE_DOOR = ("pool", "ipc")


def _skips_the_door(target: str) -> bool:
    return target.split(".")[0] in _BELOW_THE_DOOR


def test_the_api_layer_reaches_the_pool_only_through_the_session_and_the_model():
    skipping = []
    for module, path in _modules():
        if _rank(module) < ORDER.index(_API):
            continue
        for line, target in _imports(module, path):
            if _skips_the_door(target):
                skipping.append(f"neuronmp/{path.relative_to(ROOT)}:{line} imports {target}")
    assert not skipping, ("imports that skip the session and the model down to the pool "
                          "or the transport:\n" + "\n".join(skipping))


def test_the_torch_free_layers_import_no_torch():
    torch_free = ORDER[: ORDER.index("_torchscript")] + ["pool.stats", "pool.protocol"]
    offenders = []
    for module, path in _modules():
        if module not in torch_free:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "torch" or n.startswith("torch.") for n in names):
                offenders.append(f"{module}:{node.lineno}")
    assert not offenders, offenders


def test_the_rules_see_a_planted_skip_and_an_upward_import_in_a_main_block(tmp_path):
    # the checks above pass on the package; here, that they can fail
    planted = tmp_path / "parallel.py"
    planted.write_text("from .pool import answer\n"
                       "if __name__ == '__main__':\n"
                       "    from . import batching\n")
    found = list(_imports("parallel", planted))
    assert (1, "pool.answer") in found and _skips_the_door("pool.answer")
    assert _rank("parallel") >= ORDER.index(_API)
    assert (3, "batching") in found and _rank("batching") > _rank("parallel")


def _c_includes(path: pathlib.Path):
    return re.findall(r'^#include\s+"([^"]+)"', path.read_text(), re.M)


def test_the_transport_sends_row_ranges_and_the_request_path_cuts_them():
    # C has no import statements to walk: the includes are its edges.  The transport's
    # sources include only each other (it declares the row-range contract, _tensor.h);
    # the request path's cutter includes only that contract and its own copy of the
    # describing source, never the encoder's private header
    cutter = ROOT / "_rowcut.c"
    if not cutter.exists():
        pytest.skip("installed without the C sources")
    for path in sorted((ROOT / "ipc").glob("*.[ch]")):
        for name in _c_includes(path):
            assert (ROOT / "ipc" / name).exists(), f"{path.name} includes {name}"
    assert _c_includes(cutter) == ["ipc/_tensor.h", "ipc/_tensor.c"]


#: room sizes: the pool's rooms and the batching server's split by purpose
#: stay small enough to read; no module of the package grows past the second bound
_ROOM_MAX, _MODULE_MAX = 500, 700
_ROOMS = ("pool/*.py", "batch*.py")


def test_rooms_stay_small_and_no_module_grows_past_the_bound():
    too_big = []
    for path in sorted(ROOT.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        rel = path.relative_to(ROOT)
        bound = _ROOM_MAX if any(rel.match(g) for g in _ROOMS) else _MODULE_MAX
        if lines >= bound:
            too_big.append(f"neuronmp/{rel}: {lines} lines (bound {bound})")
    assert not too_big, "split by purpose: " + "; ".join(too_big)
