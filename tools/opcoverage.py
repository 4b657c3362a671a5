"""Derive which aten ops TorchNeuron runs on the device from a TorchNeuron source checkout,
and write them as neuronmp/torchneuron/coverage.py (the data the emulated device's op
tracking reads).

    python tools/opcoverage.py PATH_TO_TORCHNEURON_CHECKOUT [--out FILE]

The checkout is one the user fetched (the package directory ``torch_neuronx/`` in it);
nothing is downloaded.  What is read, as TorchNeuron registers its kernels at import:

- ``csrc/**.cpp``: ``m.impl("name", ...)`` inside ``TORCH_LIBRARY_IMPL(aten, PrivateUse1, m)``
  blocks (C++ device kernels); the kernels that record themselves as executed say so with
  ``const std::string op_name = "aten::X"`` (the name TorchNeuron's executed list shows);
  the other C++ kernels (views, copies) record nothing.
- ``csrc/core/NeuronBindings.cpp``: ``VIEW_OPS_WHITELIST``, the ops its CPU fallback runs
  without recording them as fallen back.
- ``python_ops/**.py`` but ``legacy`` and ``jax`` (which its discovery skips):
  ``@register_aten(...)`` and ``@neuron_op(...)`` decorators, and
  ``aten_lib.impl("name", fn, "PrivateUse1")`` calls (Python device kernels; they record
  themselves as executed under ``aten::name.overload``).

Only names that are operators of the installed torch are kept (an impl for an overload
torch does not have is never dispatched to).  The output is sorted, so a second run on
the same checkout and torch writes the same file.
"""
from __future__ import annotations

import argparse
import ast
import pathlib
import re
import sys
from typing import Dict, Iterable, Optional, Set, Tuple

_BLOCK = re.compile(r"TORCH_LIBRARY_IMPL\(\s*aten\s*,\s*PrivateUse1\s*,\s*m\s*\)\s*\{(.*?)\n\}",
                    re.S)
_IMPL = re.compile(r'^\s*m\.impl\(\s*"([^"]+)"', re.M)
_LOGGED = re.compile(r'const std::string op_name = "(aten::[A-Za-z0-9_.]+)"')
_WHITELIST = re.compile(r"VIEW_OPS_WHITELIST\s*=\s*\{(.*?)\};", re.S)
_QUOTED = re.compile(r'"([^"]+)"')


def _full(name: str) -> str:
    """``aten::name.overload`` (the default overload has no suffix, as torch prints it)."""
    return name if name.startswith("aten::") else "aten::" + name


def _exists(full: str) -> bool:
    import torch

    base, _, overload = full[len("aten::"):].partition(".")
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return False
    try:
        return (overload or "default") in packet.overloads()
    except Exception:
        return False


def scan_cpp(root: pathlib.Path) -> Tuple[Set[str], Set[str], Set[str]]:
    """(C++ kernel names, names they record as executed, the fallback's unrecorded views)."""
    kernels: Set[str] = set()
    logged: Set[str] = set()
    views: Set[str] = set()
    for path in sorted(root.glob("csrc/**/*.cpp")):
        text = path.read_text(errors="replace")
        for block in _BLOCK.findall(text):
            body = "\n".join(ln for ln in block.splitlines() if not ln.strip().startswith("//"))
            kernels.update(_full(n) for n in _IMPL.findall(body))
        logged.update(_LOGGED.findall(text))
        if path.name == "NeuronBindings.cpp":
            for found in _WHITELIST.findall(text):
                views.update(_QUOTED.findall(found))
    return kernels, logged, views


def _strings(node: ast.AST) -> Iterable[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, (ast.List, ast.Tuple)):
        for item in node.elts:
            yield from _strings(item)


def scan_python(root: pathlib.Path) -> Set[str]:
    """The Python device kernels' ``aten::name.overload`` names."""
    names: Set[str] = set()
    for path in sorted((root / "python_ops").rglob("*.py")):
        parts = path.relative_to(root / "python_ops").parts
        if "legacy" in parts or "jax" in parts or any("test" in p for p in parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(errors="replace"))):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("register_aten", "neuron_op"):
                names.update(_full(n) for n in _strings(node.args[0]))
            elif called == "impl" and len(node.args) >= 3:
                key = node.args[2]
                if isinstance(key, ast.Constant) and key.value == "PrivateUse1":
                    names.update(_full(n) for n in _strings(node.args[0]))
    return names


def derive(checkout: pathlib.Path) -> Tuple[Dict[str, Optional[str]], Set[str]]:
    """(device kernel -> the name its execution is recorded under, or None: not recorded;
    the fallback's unrecorded ops)."""
    root = checkout / "torch_neuronx" if (checkout / "torch_neuronx").is_dir() else checkout
    if not (root / "csrc").is_dir() or not (root / "python_ops").is_dir():
        raise SystemExit(f"{checkout}: not a TorchNeuron checkout (expected torch_neuronx/csrc "
                         f"and torch_neuronx/python_ops in it)")
    cpp, logged, views = scan_cpp(root)
    python = scan_python(root)
    kernels: Dict[str, Optional[str]] = {}
    for name in sorted(cpp | python):
        if not _exists(name):
            continue
        base = name.split(".")[0]
        if name in python:
            kernels[name] = name
        else:
            kernels[name] = base if base in logged else None
    return kernels, views


def render(kernels: Dict[str, Optional[str]], views: Set[str], source: str) -> str:
    import torch

    lines = [
        '"""The aten ops TorchNeuron runs on the device (generated by tools/opcoverage.py: do not',
        'edit; rerun it on a TorchNeuron checkout to refresh).',
        "",
        "DEVICE_OPS: ``aten::name.overload`` ops with a device kernel.  Each records its",
        "execution under its own name, but those in RECORDED_AS (another name; None: nothing).",
        "UNRECORDED_FALLBACK: ops its CPU fallback runs without recording them as fallen back.",
        "",
        f"Source: {source}; checked against torch {torch.__version__}.",
        '"""',
        "from __future__ import annotations",
        "",
        "from typing import Dict, FrozenSet, Optional",
        "",
        "DEVICE_OPS: FrozenSet[str] = frozenset({",
    ]
    lines += [f"    {k!r}," for k in sorted(kernels)]
    lines += ["})", "", "RECORDED_AS: Dict[str, Optional[str]] = {"]
    lines += [f"    {k!r}: {v!r}," for k, v in sorted(kernels.items()) if v != k]
    lines += ["}", "", "UNRECORDED_FALLBACK: FrozenSet[str] = frozenset({"]
    lines += [f"    {v!r}," for v in sorted(views)]
    lines += ["})", ""]
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=pathlib.Path, help="a TorchNeuron source checkout")
    parser.add_argument("--out", type=pathlib.Path, help="where to write (default: stdout)")
    parser.add_argument("--source", default=None, help="how the checkout is named in the file")
    args = parser.parse_args(argv)
    kernels, views = derive(args.checkout)
    text = render(kernels, views, args.source or str(args.checkout))
    if args.out:
        args.out.write_text(text)
        print(f"{len(kernels)} device kernels, {len(views)} unrecorded fallback ops -> {args.out}",
              file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
