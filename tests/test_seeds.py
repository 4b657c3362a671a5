"""The Neuron SDK pages' examples (trace, core placement,
DataParallel; copied verbatim into tests/seed_examples/)
run unchanged under NEURONMP_PROVIDE=torch_neuronx,torch_neuron, with only the
environment set: in a fresh interpreter and as a neuronmp-run rank.  Each example's
outputs must equal plain torch's and its "Executes on NeuronCore N" comments must hold
(see run_seeds.py for which examples are verbatim and which assembled).
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from provide_support import env_for, make_venv

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "run_seeds.py")
EXAMPLES = sorted(n for n in os.listdir(os.path.join(HERE, "seed_examples")) if n.endswith(".py"))
PROVIDE = "torch_neuronx,torch_neuron"


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory):
    return make_venv(tmp_path_factory.mktemp("venv"))


def _failures(report: dict) -> dict:
    assert sorted(report["examples"]) == EXAMPLES
    return {name: text for name, text in report["examples"].items() if text != "ok"}


def test_every_seed_example_runs_under_the_alias(venv_python, tmp_path, emulated):
    emulated("1x4")
    proc = subprocess.run([venv_python, RUNNER, str(tmp_path / "out.json")],
                          env=env_for(PROVIDE), cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out.json").read_text())
    assert _failures(report) == {}
    assert report["cores"] == [0, 1, 2, 3]


def test_every_seed_example_runs_as_a_neuronmp_run_rank(venv_python, tmp_path, emulated):
    # the rank's slice is global cores 4-7: the pages' nc:0..nc:3 are local indexes
    emulated("1x8")
    proc = subprocess.run([venv_python, "-m", "neuronmp.cli.run", "--cores", "4-7",
                           RUNNER, str(tmp_path / "out.json")], env=env_for(PROVIDE),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out.json.0").read_text())
    assert _failures(report) == {}
    assert report["cores"] == [4, 5, 6, 7]
