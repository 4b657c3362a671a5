"""NEURONMP_PROVIDE: the start-up hook and the torch_neuronx / torch_neuron aliases.

Every check runs in a fresh interpreter of a throwaway venv (made once per module,
seeing the running environment's packages) whose site-packages holds the hook's .pth
file, as a real install puts it there; the tree under test comes first on PYTHONPATH.
A real install of neuronmp (wheel and editable) is checked by hand: see
docs/guides/provide.md.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import textwrap

import pytest
from provide_support import ROOT, env_for, make_venv

from neuronmp import ProvideError

SDK_NAMES = ("trace", "dynamic_batch", "DataParallel", "lazy_load", "async_load",
             "move_trace_to_device", "replace_weights", "analyze", "set_neuron_cores",
             "set_multicore", "neuron_cores_context", "multicore_context")


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory):
    return make_venv(tmp_path_factory.mktemp("venv"))


def run(python, code, provide=None, extra_path=(), timeout=120):
    return subprocess.run([python, "-c", textwrap.dedent(code)],
                          env=env_for(provide, extra_path), capture_output=True, text=True,
                          timeout=timeout)


def last_json(proc):
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


STATE = """
import json, sys
print(json.dumps({"finders": [type(f).__name__ for f in sys.meta_path],
                  "loaded": sorted(m for m in ("_neuronmp_provide", "neuronmp", "torch")
                                   if m in sys.modules)}))
"""


def test_unset_changes_nothing(venv_python):
    state = last_json(run(venv_python, STATE))
    assert "AliasFinder" not in state["finders"] and state["loaded"] == []
    proc = run(venv_python, "import torch_neuronx")
    assert proc.returncode != 0 and "No module named 'torch_neuronx'" in proc.stderr


def test_set_loads_only_the_hook_until_an_alias_is_imported(venv_python):
    state = last_json(run(venv_python, STATE, provide="torch_neuronx"))
    assert "AliasFinder" in state["finders"] and state["loaded"] == ["_neuronmp_provide"]


def test_torch_neuronx_resolves_with_its_sdk_names(venv_python):
    out = last_json(run(venv_python, f"""
        import json, torch
        import torch_neuronx, torch_neuronx.experimental
        import torch.neuronx
        names = {SDK_NAMES!r}
        placement = ("set_neuron_cores", "set_multicore", "neuron_cores_context",
                     "multicore_context")
        print(json.dumps({{
            "file": torch_neuronx.__file__,
            "top": [n for n in names if not callable(getattr(torch_neuronx, n, None))],
            "experimental": [n for n in placement
                             if getattr(torch_neuronx.experimental, n) is not
                             getattr(torch_neuronx, n)],
            "torch.neuronx": torch.neuronx is torch_neuronx,
            "torch_neuron": __import__("importlib").util.find_spec("torch_neuron") is None,
        }}))
        """, provide="torch_neuronx"))
    assert out["file"].startswith(os.path.join(ROOT, "neuronmp", "provide", "torch_neuronx"))
    assert out["top"] == [] and out["experimental"] == []
    assert out["torch.neuronx"] is True
    assert out["torch_neuron"] is True        # not asked for: not provided


def test_torch_neuron_registers_torch_neuron(venv_python):
    out = last_json(run(venv_python, """
        import inspect, json, torch, torch_neuron
        import torch.neuron
        sig = inspect.signature(torch.neuron.DataParallel.__init__)
        print(json.dumps({"same": torch.neuron is torch_neuron,
                          "params": list(sig.parameters),
                          "disable": callable(torch.neuron.DataParallel.disable_dynamic_batching),
                          "trace": callable(torch.neuron.trace)}))
        """, provide=" torch_neuron , "))
    assert out == {"same": True, "params": ["self", "model", "device_ids", "dim"],
                   "disable": True, "trace": True}


def test_a_real_package_is_never_shadowed(venv_python, tmp_path):
    real = tmp_path / "real" / "torch_neuronx"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    out = last_json(run(venv_python, """
        import json, torch_neuronx
        print(json.dumps(getattr(torch_neuronx, "REAL", False)))
        """, provide="torch_neuronx", extra_path=[str(tmp_path / "real")]))
    assert out is True


def test_a_bad_value_warns_once_and_fails_the_import_clearly(venv_python):
    start = run(venv_python, "pass", provide="torch_neuronx,torch_cuda")
    assert start.returncode == 0
    lines = start.stderr.strip().splitlines()
    assert len(lines) == 1 and "torch_cuda" in lines[0] and "Traceback" not in start.stderr
    proc = run(venv_python, """
        try:
            import torch_neuronx
        except ImportError as exc:
            print(type(exc).__name__, exc.variable, exc.value, exc.unknown, exc.accepted)
        """, provide="torch_neuronx,torch_cuda")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split(" ", 1) == [
        "ProvideError", "NEURONMP_PROVIDE torch_neuronx,torch_cuda ('torch_cuda',) "
        "('torch_neuronx', 'torch_neuron')\n"]


CHILDREN = """
import json, multiprocessing as mp, subprocess, sys

def probe(q):
    import torch_neuronx
    q.put(torch_neuronx.__name__)

if __name__ == "__main__":
    seen = {}
    seen["subprocess"] = subprocess.run(
        [sys.executable, "-c", "import torch_neuronx; print(torch_neuronx.__name__)"],
        capture_output=True, text=True, timeout=120).stdout.strip()
    for method in ("spawn", "forkserver"):
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=probe, args=(q,))
        p.start()
        seen[method] = q.get(timeout=120)
        p.join(timeout=60)
    print(json.dumps(seen))
"""


def test_every_python_child_gets_the_aliases(venv_python, tmp_path):
    script = tmp_path / "children.py"
    script.write_text(CHILDREN)
    proc = run(venv_python, f"import runpy; runpy.run_path({str(script)!r}, "
               "run_name='__main__')", provide="torch_neuronx")
    assert last_json(proc) == {"subprocess": "torch_neuronx", "spawn": "torch_neuronx",
                               "forkserver": "torch_neuronx"}


def test_torchrun_ranks_get_the_aliases(venv_python, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text("import os, torch_neuronx\n"
                      "with open(os.environ['OUT'] + os.environ['RANK'], 'w') as f:\n"
                      "    f.write(torch_neuronx.__name__)\n")
    proc = subprocess.run([venv_python, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(script)],
                          env=env_for("torch_neuronx", OUT=str(tmp_path / "rank")),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["torch_neuronx"] * 2

XDIST_TEST = """
import os

def test_alias(worker_id):
    import torch_neuronx
    assert torch_neuronx.__spec__.origin.startswith({root!r}), torch_neuronx.__spec__.origin
    with open(os.path.join({out!r}, worker_id), "w") as f:
        f.write(torch_neuronx.__name__)

def test_alias_again(worker_id):
    test_alias(worker_id)
"""


@pytest.mark.parametrize("how", ["environment", "--neuron-provide"])
def test_pytest_xdist_workers_get_the_aliases(venv_python, tmp_path, how):
    pytest.importorskip("xdist")
    out = tmp_path / "seen"
    out.mkdir()
    (tmp_path / "test_user.py").write_text(XDIST_TEST.format(root=ROOT, out=str(out)))
    option = ["--neuron-provide", "torch_neuronx"] if how != "environment" else []
    proc = subprocess.run(
        [venv_python, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
         "-p", "no:randomly", *option, str(tmp_path / "test_user.py")],
        env=env_for("torch_neuronx" if how == "environment" else None),
        capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # two xdist worker processes, each imported the alias itself
    assert sorted(p.name for p in out.iterdir()) == ["gw0", "gw1"]
    assert {p.read_text() for p in out.iterdir()} == {"torch_neuronx"}


def test_provide_error_names_variable_value_and_accepted_and_pickles():
    err = ProvideError("NEURONMP_PROVIDE", "torch_cuda", ["torch_cuda"],
                                ["torch_neuronx", "torch_neuron"])
    assert isinstance(err, ImportError)
    text = str(err)
    assert "NEURONMP_PROVIDE='torch_cuda'" in text and "torch_neuronx, torch_neuron" in text
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == text and again.unknown == ("torch_cuda",)
