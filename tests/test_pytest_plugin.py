"""The pytest plugin as a user's project meets it: pytest run in a subprocess on test files
in a fresh directory with no conftest, plus the fixture beside this project's own conftest."""
from __future__ import annotations

import configparser
import json
import os
import time
from importlib import metadata
from pathlib import Path

import psutil
import pytest

# the entry point loads the plugin where neuronmp is installed with it; naming the module
# here too loads it once either way (the entry point carries the module's name)
pytest_plugins = ["pytester", "neuronmp.pytest_plugin"]
PLUGIN = ["-p", "neuronmp.pytest_plugin"]
ROOT = Path(__file__).resolve().parent.parent

SHOW = "import json, neuronmp; print(json.dumps(list(neuronmp.visible_cores())))"

USER_TESTS = '''
import json

SHOW = "import json, neuronmp; print(json.dumps(list(neuronmp.visible_cores())))"
HOLD = """
import sys, neuronmp
neuronmp.init()
print("ready", flush=True)
sys.stdin.readline()
"""


def test_visible_cores(neuron_host):
    assert neuron_host.name == "4x4" and neuron_host.topology.num_cores == 16
    assert neuron_host.run(SHOW, env={"NEURON_RT_VISIBLE_CORES": "0-1"}).json == [0, 1]
    assert neuron_host.run(SHOW, env={"NEURON_RT_NUM_CORES": "3"}).json == [0, 1, 2]
    bad = neuron_host.run(SHOW, env={"NEURON_RT_VISIBLE_CORES": "3,5"})
    assert bad.returncode != 0 and "NEURON_RT_VISIBLE_CORES='3,5'" in bad.stderr


def test_partition_clash_names_the_holder(neuron_host):
    holder = neuron_host.start(HOLD, env={"NEURON_RT_VISIBLE_CORES": "0-1"})
    assert holder.stdout.readline() == "ready\\n"
    clash = neuron_host.run(SHOW, env={"NEURON_RT_VISIBLE_CORES": "1-2"})
    assert clash.returncode != 0
    assert "Requested:nc1-nc2" in clash.stderr and f"pid {holder.pid}" in clash.stderr
    device = neuron_host.devices()[0]
    assert [p["pid"] for p in device["neuron_processes"]] == [holder.pid]
    holder.stdin.close()
    assert neuron_host.wait(holder).ok
    assert neuron_host.run(SHOW, env={"NEURON_RT_VISIBLE_CORES": "1-2"}).json == [1, 2]


def test_script_with_arguments(neuron_host, tmp_path):
    script = tmp_path / "launch.py"
    script.write_text("import json, sys, neuronmp\\n"
                      "print(json.dumps([sys.argv[1:], neuronmp.core_count()]))\\n")
    result = neuron_host.run(script, args=["--ranks", 2], env={"NEURON_RT_NUM_CORES": "4"})
    assert result.json == [["--ranks", "2"], 4]


def test_holder_left_running_is_stopped_at_teardown(neuron_host):
    holder = neuron_host.start(HOLD, env={"NEURON_RT_VISIBLE_CORES": "15"})
    assert holder.stdout.readline() == "ready\\n"
    with open("holder.pid", "w") as f:  # pytest's working directory
        f.write(str(holder.pid))
'''

SETTINGS_TESTS = '''
import os
import pytest

ENV = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in "
       "('NEURONMP_TOPOLOGY', 'NEURONMP_PROVIDE', 'NEURON_LOGICAL_NC_CONFIG')}))")
COUNT = "import json, neuronmp; print(json.dumps(neuronmp.core_count()))"


def test_option_sets_the_default_host(neuron_host):
    assert neuron_host.name == "trn1.32xlarge" and neuron_host.run(COUNT).json == 32
    assert neuron_host.run(ENV).json == {"NEURONMP_TOPOLOGY": "trn1.32xlarge",
                                         "NEURONMP_PROVIDE": "torch_neuronx,torch_neuron",
                                         "NEURON_LOGICAL_NC_CONFIG": None}
    assert os.environ["NEURONMP_TOPOLOGY"] == "trn1.32xlarge"  # the test's process too


@pytest.mark.neuron_topology("inf2.48xlarge")
def test_marker_wins(neuron_host):
    assert neuron_host.run(COUNT).json == 24


@pytest.mark.neuron_topology("trn2.48xlarge")
def test_trn2_logical_cores(neuron_host):
    assert neuron_host.topology.lnc == 2 and neuron_host.run(COUNT).json == 64
    assert neuron_host.run(COUNT, env={"NEURON_LOGICAL_NC_CONFIG": "1"}).json == 128


@pytest.mark.neuron_topology("trn2.3xlarge", lnc=1)
def test_marker_lnc(neuron_host):
    assert neuron_host.run(COUNT).json == 8
    assert neuron_host.run(ENV).json["NEURON_LOGICAL_NC_CONFIG"] == "1"


@pytest.mark.neuron_topology("trn1.2xlarge", lnc=2)
def test_marker_with_unsupported_lnc(neuron_host):
    pass


def test_provide_reaches_pytests_own_process():
    import torch
    import torch_neuron
    import torch_neuronx

    assert torch.neuron is torch_neuron and callable(torch_neuronx.experimental.set_multicore)
'''

LEAK_TESTS = '''
import os

GRANDCHILD = """
import subprocess, sys
code = "import time, neuronmp; neuronmp.init(); print('held', flush=True); time.sleep(60)"
p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                     stdout=subprocess.PIPE, text=True)
assert p.stdout.readline() == "held\\\\n"
print(p.pid)
"""
SEGMENT = ("import os; from neuronmp.shm.segment import Segment; "
           "print(Segment.create(4096).name, flush=True); os._exit(0)")


def test_leaks_a_process_holding_a_core(neuron_host):
    result = neuron_host.run(GRANDCHILD, env={"NEURON_RT_VISIBLE_CORES": "2"})
    assert result.ok, result.stderr
    with open(os.environ["LEAK_RECORD"], "w") as f:
        f.write(result.stdout.strip())


def test_leaks_a_segment(neuron_host):
    assert neuron_host.run(SEGMENT).ok


def test_clean(neuron_host):
    assert neuron_host.run("print(1)").json == 1
'''


def run_user_pytest(pytester, *args):
    return pytester.runpytest_subprocess(*PLUGIN, *args, timeout=300)


def test_user_test_file_in_a_fresh_directory_passes(pytester):
    assert not list(pytester.path.glob("conftest.py"))
    pytester.makepyfile(test_user=USER_TESTS)
    result = run_user_pytest(pytester, "-v")
    result.assert_outcomes(passed=4)
    holder = int((pytester.path / "holder.pid").read_text())
    assert not _running(holder)  # stopped by the fixture, not by the end of pytest


def test_option_marker_and_provide(pytester):
    pytester.makepyfile(test_settings=SETTINGS_TESTS)
    result = run_user_pytest(pytester, "--neuron-topology", "trn1.32xlarge",
                             "--neuron-provide", "torch_neuronx, torch_neuron")
    result.assert_outcomes(passed=5, errors=1)
    result.stdout.fnmatch_lines(["*NEURON_LOGICAL_NC_CONFIG='2'*trn1.2xlarge*"])


def test_ini_sets_the_default_host(pytester):
    pytester.makeini("[pytest]\nneuron_topology = inf1.6xlarge\n")
    pytester.makepyfile(test_ini="def test_host(neuron_host):\n"
                        "    assert neuron_host.topology.num_cores == 16\n"
                        "    assert neuron_host.topology.name == 'inf1.6xlarge'\n")
    run_user_pytest(pytester).assert_outcomes(passed=1)


@pytest.mark.parametrize("args,quoted", [
    (["--neuron-topology", "inf9.huge"], "'inf9.huge'"),
    (["--neuron-provide", "torch_cuda"], "'torch_cuda'"),
])
def test_bad_options_are_usage_errors(pytester, args, quoted):
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = run_user_pytest(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert quoted in result.stderr.str()


def test_leaks_fail_the_test_that_made_them(pytester, monkeypatch, tmp_path):
    record = tmp_path / "leaked.pid"
    monkeypatch.setenv("LEAK_RECORD", str(record))
    pytester.makepyfile(test_leaks=LEAK_TESTS)
    result = run_user_pytest(pytester)
    result.assert_outcomes(passed=3, errors=2)
    out = result.stdout.str()
    pid = int(record.read_text())
    assert "ERROR at teardown of test_leaks_a_process_holding_a_core" in out
    assert f"neuron_host leaked: process {pid} (" in out
    assert "core lock nc2.lock still held" in out
    assert "ERROR at teardown of test_leaks_a_segment" in out
    assert "shared-memory segment nmp-" in out
    assert not _running(pid)  # and the fixture killed what leaked


def test_fixture_beside_this_projects_conftest(neuron_host, runtime_dir):
    assert os.environ["NEURONMP_RUNTIME_DIR"] == neuron_host.runtime_dir != runtime_dir
    assert neuron_host.run(SHOW, env={"NEURON_RT_VISIBLE_CORES": "2-3"}).json == [2, 3]


def test_entry_point_names_the_module():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options.entry_points"]["pytest11"].split()
    assert lines == ["neuronmp.pytest_plugin", "=", "neuronmp.pytest_plugin"]
    installed = [ep for ep in metadata.entry_points(group="pytest11")
                 if ep.value == "neuronmp.pytest_plugin"]
    assert all(ep.name == ep.value for ep in installed)


def _running(pid: int, wait: float = 5.0) -> bool:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            return False
        time.sleep(0.05)
    return True


def test_result_json_explains_a_missing_document(neuron_host):
    result = neuron_host.run("import sys; print('not json'); sys.exit(3)")
    assert (result.returncode, result.ok) == (3, False)
    with pytest.raises(AssertionError, match="no JSON on its last line"):
        _ = result.json
    assert json.loads(neuron_host.run("print('[1, 2]')").stdout) == [1, 2]


def test_installed_tools_answer_children_that_shell_out(neuron_host):
    # (the marker is exercised in pytester runs: here the plugin may load after decoration)
    neuron_host.install_tools()
    ray_like = ("import json, subprocess; out = subprocess.run(['neuron-ls', '--json-output'], "
                "capture_output=True, check=True).stdout; "
                "print(json.dumps(sum(d['nc_count'] for d in json.loads(out))))")
    assert neuron_host.run(ray_like).json == 16


def test_plugin_import_is_cheap(procs):
    p = procs.python("import sys, neuronmp.pytest_plugin; "
                     "sys.exit(1 if 'torch' in sys.modules or 'psutil' in sys.modules else 0)")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
