"""tools/conformance.py, run for real on a small suite made here in TorchNeuron's layout:
the environment each directory gets, exclusions, unexpected passes, torchrun ranks, a
directory that outlives its timeout, and a suite given as a git directory."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

TOOL = pathlib.Path(__file__).resolve().parent.parent / "tools" / "conformance.py"
VENV = pathlib.Path(sys.executable).parent.parent   # this interpreter's environment

pytestmark = pytest.mark.timeout(900)

FILES = {
    "conftest.py": "",
    # a package of the suite's own name at its root: never copied, so the stand-in wins
    "torch_neuronx/__init__.py": "raise ImportError('the real package was imported')\n",
    "tests/__init__.py": "",
    "tests/helpers.py": "VALUE = 42\n",
    "tests/alpha/__init__.py": "",
    "tests/alpha/test_a.py": """
        import os
        import pytest
        from tests.helpers import VALUE

        def test_pass():
            assert VALUE == 42

        def test_fail():
            assert False, "fails on purpose"

        def test_skip():
            pytest.skip("skipped on purpose")

        @pytest.mark.xfail(reason="fails on the hardware")
        def test_xfail():
            assert False

        @pytest.mark.xfail(reason="fails on the hardware")
        def test_xpass():
            assert True

        def test_env():
            assert os.environ["NEURONMP_PROVIDE"] == "torchneuron"
            assert os.environ["NEURON_RT_NUM_CORES"] == "1"
            assert os.environ["TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS"] == "1"

        def test_deselected():
            assert False, "deselected by the exclusion list"
        """,
    "tests/alpha/test_ignored.py": "def test_ignored():\n    assert False\n",
    "tests/alpha/test_broken.py": "import a_module_that_does_not_exist\n",
    "tests/cpu_fallback/test_b.py": """
        import os

        def test_fallback_env():
            assert os.environ["TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS"] == "0"

        def test_standin():
            import torch_neuronx
            assert "neuronmp" in torch_neuronx.__file__
        """,
    "tests/nki/test_c.py": "def test_needs_hardware():\n    assert False\n",
    "tests/distributed/process_group/test_process_group_neuron.py": """
        import os

        def test_ranks():
            assert os.environ["WORLD_SIZE"] == "2" and os.environ["RANK"] in ("0", "1")

        def test_rank_one_fails():
            assert os.environ["RANK"] == "0"
        """,
    "tests/distributed/process_group/test_alone.py": """
        import os

        def test_not_a_rank():
            assert "WORLD_SIZE" not in os.environ
        """,
}
HANG = "import time\n\ndef test_hangs():\n    time.sleep(600)\n"

EXCLUDED = """\
# header comment
tests/nki # needs the hardware
tests/alpha/test_ignored.py # a whole file
tests/alpha/test_a.py::test_deselected # one test
"""


@pytest.fixture
def suite(tmp_path):
    root = tmp_path / "suite"
    for name, text in FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    (tmp_path / "exclusions.txt").write_text(EXCLUDED)
    return root


def _tool(suite, tmp_path, *args, json_out=True):
    cmd = [sys.executable, str(TOOL), str(suite), "--venv", str(VENV),
           "--exclusions", str(tmp_path / "exclusions.txt"), *args]
    proc = subprocess.run(cmd + (["--json"] if json_out else []), capture_output=True,
                          text=True, timeout=800, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout) if json_out else proc.stdout


def _rows(report):
    return {r["directory"]: r for r in report["results"]}


def test_every_directory_runs_with_the_suites_environment_and_is_counted(suite, tmp_path):
    report = _tool(suite, tmp_path, "--timeout", "300")
    rows = _rows(report)
    assert set(rows) == {"tests/alpha", "tests/cpu_fallback", "tests/distributed/process_group"}
    alpha = rows["tests/alpha"]
    assert {k: alpha[k] for k in ("collected", "passed", "failed", "error", "skipped",
                                  "xfailed", "xpassed")} == {
        "collected": 6, "passed": 2, "failed": 1, "error": 1, "skipped": 1, "xfailed": 1,
        "xpassed": 1}
    assert alpha["xpassed_tests"] == ["tests/alpha/test_a.py::test_xpass"]
    fallback = rows["tests/cpu_fallback"]
    assert (fallback["passed"], fallback["failed"], fallback["error"]) == (2, 0, 0)
    ranks = rows["tests/distributed/process_group"]
    # two ranks under torchrun (a test passes only if both did), one file alone
    assert (ranks["passed"], ranks["failed"]) == (2, 1), ranks
    assert report["not_run"] == ["tests/nki"]
    assert report["forked"] is False          # this environment has no pytest-forked
    assert {"entry": "tests/nki", "reason": "needs the hardware"} in report["excluded"]
    assert len(report["excluded"]) == 3


def test_the_lnc1_file_runs_by_itself_with_the_environment_the_suites_runner_gives_it(
        suite, tmp_path):
    device = suite / "tests" / "device"
    device.mkdir()
    (device / "test_device_lnc1_all_cores.py").write_text(textwrap.dedent("""
        import os

        def test_lnc1_env():
            assert os.environ["NEURON_LOGICAL_NC_CONFIG"] == "1"
            assert "NEURON_RT_NUM_CORES" not in os.environ
            assert os.environ["NEURONMP_TOPOLOGY"] == "trn2.48xlarge"
        """))
    (device / "test_other.py").write_text(textwrap.dedent("""
        import os

        def test_one_core():
            assert os.environ["NEURON_RT_NUM_CORES"] == "1"
            assert os.environ.get("NEURON_LOGICAL_NC_CONFIG") != "1"
        """))
    env = {k: v for k, v in os.environ.items()
           if k not in ("NEURONMP_TOPOLOGY", "NEURON_LOGICAL_NC_CONFIG")}
    proc = subprocess.run([sys.executable, str(TOOL), str(suite), "--venv", str(VENV),
                           "--exclusions", str(tmp_path / "exclusions.txt"), "--dirs",
                           "device", "--json"], capture_output=True, text=True, timeout=800,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = _rows(json.loads(proc.stdout))["tests/device"]
    assert (row["collected"], row["passed"], row["failed"]) == (2, 2, 0), row


def test_a_directory_past_its_timeout_is_stopped_and_said(suite, tmp_path):
    (suite / "tests" / "hang").mkdir()
    (suite / "tests" / "hang" / "test_h.py").write_text(HANG)
    # the timeout bounds alpha's own pytest run too (a second or two on a quiet host), and
    # every second of it is spent waiting on the hang: short, with room for alpha
    out = _tool(suite, tmp_path, "--dirs", "hang", "alpha", "--timeout", "10", json_out=False)
    lines = out.splitlines()
    assert lines[0].startswith("TorchNeuron suite") and "without --forked" in lines[0]
    assert lines[1].split() == ["directory", "collected", "passed", "failed", "errors",
                                "skipped", "xfail", "XPASS", "note"]
    hang = next(line for line in lines if line.startswith("tests/hang"))
    assert "timed out after 10 s" in hang
    assert next(line for line in lines if line.startswith("tests/alpha")).split()[1:] == [
        "6", "2", "1", "1", "1", "1", "1"]
    assert "  tests/nki  # needs the hardware" in lines
    assert not list(tmp_path.glob("**/_conformance_plugin.py"))   # its scratch is removed


def test_a_git_directory_without_a_work_tree_is_extracted(suite, tmp_path):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(suite)]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "suite"], check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    bare = tmp_path / "suite.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(suite), str(bare)], check=True)
    shutil.rmtree(suite)
    report = _tool(bare, tmp_path, "--dirs", "tests/alpha")
    assert report["commit"] == head
    assert _rows(report)["tests/alpha"]["passed"] == 2


def test_a_directory_not_in_the_suite_is_refused_naming_the_ones_there(suite, tmp_path):
    proc = subprocess.run([sys.executable, str(TOOL), str(suite), "--venv", str(VENV),
                           "--dirs", "nonesuch"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "tests/nonesuch: not in the suite" in proc.stderr and "tests/alpha" in proc.stderr


HOST_FILE = """
import json, os, stat

def test_host():
    runtime = os.environ["NEURONMP_RUNTIME_DIR"]
    with open({out!r}, "w") as f:
        json.dump({{"topology": os.environ["NEURONMP_TOPOLOGY"], "runtime": runtime,
                   "mode": stat.S_IMODE(os.stat(runtime).st_mode)}}, f)
"""


@pytest.mark.parametrize("user_topology", [None, "2x4"])
def test_the_suites_host_and_a_runtime_directory_of_its_own_unless_the_user_set_them(
        suite, tmp_path, monkeypatch, user_topology):
    """The default runtime directory's cores may be held by any other neuronmp process
    of the user; the 2-core default host has too few cores for the suite's four-rank
    tests."""
    out = tmp_path / "host.json"
    (suite / "tests" / "host").mkdir()
    (suite / "tests" / "host" / "test_h.py").write_text(HOST_FILE.format(out=str(out)))
    monkeypatch.delenv("NEURONMP_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("NEURONMP_TOPOLOGY", raising=False)
    if user_topology:
        monkeypatch.setenv("NEURONMP_TOPOLOGY", user_topology)
    assert _rows(_tool(suite, tmp_path, "--dirs", "host"))["tests/host"]["passed"] == 1
    seen = json.loads(out.read_text())
    assert seen["topology"] == (user_topology or "trn2.48xlarge")
    runtime = pathlib.Path(seen["runtime"])
    assert runtime.name.startswith("neuronmp-conformance-") and seen["mode"] == 0o700
    assert not runtime.exists()   # removed with the run


def _forks() -> bool:
    try:
        import pytest_forked  # noqa: F401
    except ImportError:
        return False
    return int(pytest.__version__.split(".")[0]) < 9


@pytest.mark.skipif(not _forks(), reason="needs pytest-forked with a pytest before 9")
def test_a_forked_test_past_its_timeout_fails_and_the_directory_goes_on(suite, tmp_path):
    (suite / "tests" / "slow").mkdir()
    (suite / "tests" / "slow" / "test_s.py").write_text(
        "import time\n\ndef test_a_slow():\n    time.sleep(60)\n\n"
        "def test_b_after():\n    pass\n")
    report = _tool(suite, tmp_path, "--dirs", "slow", "--test-timeout", "3")
    assert report["forked"] is True
    row = _rows(report)["tests/slow"]
    assert (row["collected"], row["passed"], row["failed"], row["notes"]) == (2, 1, 1, [])


def test_a_virtualenv_with_another_checkouts_neuronmp_is_refused_naming_both(suite, tmp_path):
    """A reused virtualenv would test whatever neuronmp it holds: one made on an earlier
    day, or by another checkout, is named instead of silently run."""
    venv = tmp_path / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    other = tmp_path / "elsewhere"
    (other / "neuronmp").mkdir(parents=True)
    (other / "neuronmp" / "__init__.py").write_text("")
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "elsewhere.pth").write_text(str(other) + "\n")
    proc = subprocess.run([sys.executable, str(TOOL), str(suite), "--venv", str(venv)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"imports neuronmp from {other}, not from this checkout" in proc.stderr
    assert str(TOOL.parent.parent) in proc.stderr
