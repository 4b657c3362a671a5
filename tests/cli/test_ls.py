"""neuronmp-ls: inventory and holders, without ever taking a lock."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

from neuronmp.cli import ls
from neuronmp.host import reservation, settings, topology
from neuronmp.host.visibility import Request

HOLD = r"""
import os, sys
import neuronmp
neuronmp.init()
print(os.getpid(), flush=True)
sys.stdin.readline()
"""


def run_ls(procs, *args, env=None):
    exe = shutil.which("neuronmp-ls")
    argv = [exe] if exe else [sys.executable, "-m", "neuronmp.cli.ls"]
    p = procs.popen(argv + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True, env={**os.environ, **(env or {})})
    out, err = p.communicate(timeout=30)
    return p.returncode, out, err


def test_json_reports_holders_of_running_reservation(procs, emulated):
    topo = emulated("inf1.6xlarge")
    holder = procs.python(HOLD, env={"NEURON_RT_VISIBLE_CORES": "5-7"}, stdin=subprocess.PIPE)
    pid = int(holder.stdout.readline())
    code, out, err = run_ls(procs, "--json")
    assert code == 0, err
    inv = json.loads(out)
    assert inv["topology"]["name"] == "inf1.6xlarge" and inv["topology"]["num_cores"] == 16
    assert inv["held"] == 3 and inv["free"] == 13
    by_core = {c["core"]: c for c in inv["cores"]}
    for core in range(16):
        entry = by_core[core]
        assert entry["chip"] == core // 4 and entry["cpus"] == list(topo.cpus_of(core))
        if core in (5, 6, 7):
            assert entry["held"] and entry["holder"]["pid"] == pid
            assert "neuronmp.init()" in entry["holder"]["command"]
            assert entry["holder"]["cores"] == [5, 6, 7] and entry["holder"]["host"]
        else:
            assert not entry["held"] and entry["holder"] is None
    assert [(h["pid"], h["cores"]) for h in inv["holders"]] == [(pid, [5, 6, 7])]

    holder.stdin.close()
    assert holder.wait(timeout=20) == 0
    inv = json.loads(run_ls(procs, "--json")[1])
    assert inv["held"] == 0 and inv["holders"] == []


def test_table_names_holder_and_cpus(procs, emulated):
    emulated("inf2.xlarge")
    holder = procs.python(HOLD, env={"NEURON_RT_NUM_CORES": "1"}, stdin=subprocess.PIPE)
    pid = int(holder.stdout.readline())
    code, out, _ = run_ls(procs)
    assert code == 0
    assert "emulated instance: inf2.xlarge  1 chip(s) x 2 core(s) = 2 NeuronCores" in out
    assert "(1 held, 1 free)" in out
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    assert rows[0][:4] == ["0", "0", rows[0][2], "pid"] and rows[0][4] == str(pid)
    assert rows[1][3] == "-"
    assert f"pid {pid} holds nc0: " in out
    holder.stdin.close()
    holder.wait(timeout=20)


def test_missing_runtime_dir_is_not_created(procs, runtime_dir):
    missing = os.path.join(runtime_dir, "not-yet")
    code, out, _ = run_ls(procs, "--json", env={"NEURONMP_RUNTIME_DIR": missing})
    assert code == 0
    inv = json.loads(out)
    assert inv["held"] == 0 and inv["free"] == 16 and inv["runtime_dir"] == missing
    assert not os.path.exists(missing)


def test_unsafe_runtime_dir_refused(procs, runtime_dir):
    os.chmod(runtime_dir, 0o777)
    try:
        code, out, err = run_ls(procs)
    finally:
        os.chmod(runtime_dir, 0o700)
    assert code == 2 and out == ""
    assert "Refusing runtime directory" in err and "writable by others" in err


def test_does_not_import_torch(procs):
    code = ("import sys; from neuronmp.cli import ls; ls.main(['--json']); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    p = procs.python(code)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert json.loads(out)["topology"]["name"] == "4x4"


def test_inventory_never_takes_a_lock():
    """While inventories run back to back, another descriptor probes the same lock files
    the whole time: any lock taken by the inventory, however briefly, makes a probe fail."""
    held = reservation.reserve(Request(cores=(3,)), topology.parse("4x4", cpus=[0]))
    directory = held.directory
    fds = [os.open(reservation.lock_path(directory, c), os.O_RDWR | os.O_CREAT, 0o600)
           for c in (0, 1, 2)]
    fds.append(os.open(os.path.join(directory, "alloc.lock"), os.O_RDWR | os.O_CREAT, 0o600))
    stop = threading.Event()
    clashes = []
    inventories = []

    def inventory_loop():
        while not stop.is_set() and len(inventories) < 300:
            inventories.append(ls.inventory())
        stop.set()

    t = threading.Thread(target=inventory_loop)
    t.start()
    try:
        while not stop.is_set():
            for fd in fds:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    clashes.append(fd)
                    continue
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        stop.set()
        t.join(timeout=30)
        for fd in fds:
            os.close(fd)
        held.release()
    assert len(inventories) >= 300
    assert not clashes
    # and what it saw was right throughout: core 3 held by us, at most the probed ones
    # momentarily "held" by the probe itself
    for inv in inventories:
        assert inv["cores"][3]["held"] and inv["cores"][3]["holder"]["pid"] == os.getpid()
        assert not any(c["held"] for c in inv["cores"][4:])


# -- --json-output: the real neuron-ls schema -------------------------------------------

#: the keys of one device in a real trn1.2xlarge capture, in the tool's order
REAL_KEYS = ["neuron_device", "bdf", "cpu_affinity", "numa_node", "connected_to", "nc_count",
             "memory_size", "neuroncore_ids", "neuron_processes"]


def ray_core_count(stdout: str) -> int:
    """Ray's rule (NeuronAcceleratorManager): the sum of nc_count over the devices."""
    return sum(int(d.get("nc_count", 0)) for d in json.loads(stdout))


def djl_device_count(stdout: str) -> int:
    """DJL Serving's rule: one entry per device."""
    return len(json.loads(stdout))


def test_json_output_matches_a_real_one_device_capture(procs, emulated):
    emulated("trn1.2xlarge")
    code, out, err = run_ls(procs, "--json-output")
    assert code == 0, err
    assert out.startswith("[\n    {\n") and out.endswith("]")  # indent 4, no newline
    [dev] = json.loads(out)
    assert list(dev) == REAL_KEYS
    cpus = sorted({c for core in (0, 1) for c in settings.get("topology").cpus_of(core)})
    assert dev == {
        "neuron_device": 0, "bdf": dev["bdf"], "cpu_affinity": ls._cpulist(cpus),
        "numa_node": dev["numa_node"], "connected_to": None, "nc_count": 2,
        "memory_size": 34359738368, "neuroncore_ids": [0, 1], "neuron_processes": [],
    }
    assert isinstance(dev["numa_node"], str) and int(dev["numa_node"]) >= -1
    assert len(dev["bdf"].split(":")) == 3
    assert (ray_core_count(out), djl_device_count(out)) == (2, 1)


def test_json_output_names_holders_per_device(procs, emulated):
    emulated("inf1.6xlarge")
    holder = procs.python(HOLD, env={"NEURON_RT_VISIBLE_CORES": "3-5"}, stdin=subprocess.PIPE)
    pid = int(holder.stdout.readline())
    code, out, err = run_ls(procs, "-j")
    assert code == 0, err
    devices = json.loads(out)
    assert (ray_core_count(out), djl_device_count(out)) == (16, 4)
    assert [d["neuroncore_ids"] for d in devices] == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                      [8, 9, 10, 11], [12, 13, 14, 15]]
    assert [d["connected_to"] for d in devices] == [[1], [2, 0], [3, 1], [2]]
    assert all(d["memory_size"] == 8 << 30 for d in devices)
    for dev in devices[:2]:  # cores 3 and 4-5: one entry per process on each device
        [proc] = dev["neuron_processes"]
        assert set(proc) == {"pid", "command", "neuron_runtime_version"}
        assert proc["pid"] == pid and "neuronmp.init()" in proc["command"]
    assert devices[2]["neuron_processes"] == devices[3]["neuron_processes"] == []
    holder.stdin.close()
    assert holder.wait(timeout=20) == 0
    assert all(d["neuron_processes"] == [] for d in json.loads(run_ls(procs, "-j")[1]))


def test_json_output_trn2_logical_cores(procs, emulated):
    emulated("trn2.48xlarge")
    code, out, err = run_ls(procs, "--json-output")
    assert code == 0, err
    devices = json.loads(out)
    assert (ray_core_count(out), djl_device_count(out)) == (64, 16)
    first, last = devices[0], devices[15]
    assert list(first) == REAL_KEYS[:6] + ["logical_neuroncore_config"] + REAL_KEYS[6:]
    assert first["logical_neuroncore_config"] == 2 and first["memory_size"] == 96 << 30
    assert first["connected_to"] == [12, 3, 4, 1] and last["connected_to"] == [11, 14, 3, 12]
    assert last["neuroncore_ids"] == [60, 61, 62, 63]
    code, out, err = run_ls(procs, "--json-output", env={"NEURON_LOGICAL_NC_CONFIG": "1"})
    assert code == 0, err
    devices = json.loads(out)
    assert ray_core_count(out) == 128
    assert devices[15]["neuroncore_ids"] == list(range(120, 128))
    assert devices[15]["logical_neuroncore_config"] == 1


def test_json_output_failure_prints_nothing_and_exits_1(procs, runtime_dir):
    code, out, err = run_ls(procs, "--json-output", env={"NEURONMP_TOPOLOGY": "trn1.2xlarge",
                                                         "NEURON_LOGICAL_NC_CONFIG": "2"})
    assert (code, out) == (1, "")
    assert "NEURON_LOGICAL_NC_CONFIG='2'" in err and "trn1.2xlarge" in err
    os.chmod(runtime_dir, 0o777)
    try:
        code, out, err = run_ls(procs, "--json-output")
    finally:
        os.chmod(runtime_dir, 0o700)
    assert (code, out) == (1, "")
    assert "writable by others" in err


# -- --install-tools ------------------------------------------------------------------------


def test_installed_neuron_ls_shows_the_callers_host(procs, tmp_path):
    bin_dir = tmp_path / "opt" / "aws" / "neuron" / "bin"
    code, out, err = run_ls(procs, "--install-tools", str(bin_dir))
    assert code == 0, err
    for name in ("neuron-ls", "neuron-top", "neuron-monitor"):
        assert os.access(bin_dir / name, os.X_OK) and f"installed {bin_dir / name}" in out
    # as a tool would run it: by path, from elsewhere, with only the caller's environment
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for topo, lnc, cores, devices in [("trn2.3xlarge", None, 4, 1),
                                      ("trn2.48xlarge", "1", 128, 16),
                                      ("inf2.48xlarge", None, 24, 12)]:
        env["NEURONMP_TOPOLOGY"] = topo
        env.pop("NEURON_LOGICAL_NC_CONFIG", None)
        if lnc:
            env["NEURON_LOGICAL_NC_CONFIG"] = lnc
        p = subprocess.run([str(bin_dir / "neuron-ls"), "--json-output"], env=env,
                           cwd=str(tmp_path), capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stderr
        assert (ray_core_count(p.stdout), djl_device_count(p.stdout)) == (cores, devices)
    top = subprocess.run([str(bin_dir / "neuron-top"), "--once", "--json", "--interval",
                          "0.1"], env=env, capture_output=True, text=True, timeout=30)
    assert top.returncode == 0, top.stderr
    assert json.loads(top.stdout)["topology"]["name"] == "inf2.48xlarge"
    conf = tmp_path / "monitor.conf"
    conf.write_text('{"period": "100ms", "system_metrics": [{"type": "neuron_hw_counters"}]}')
    monitor = procs.popen([str(bin_dir / "neuron-monitor"), "-c", str(conf)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    report = json.loads(monitor.stdout.readline())
    monitor.kill()
    assert report["neuron_hardware_info"]["neuron_device_count"] == 12
    assert len(report["system_data"]["neuron_hw_counters"]["neuron_devices"]) == 12


def test_install_tools_never_replaces_a_real_tool(procs, tmp_path):
    real = tmp_path / "neuron-ls"
    real.write_text("#!/bin/sh\necho real neuron-ls\n")
    code, out, err = run_ls(procs, "--install-tools", str(tmp_path))
    assert code == 1 and "refusing to replace" in err and str(real) in err
    assert real.read_text() == "#!/bin/sh\necho real neuron-ls\n"
    assert not (tmp_path / "neuron-top").exists()  # all or nothing
    real.unlink()
    assert run_ls(procs, "--install-tools", str(tmp_path))[0] == 0
    assert run_ls(procs, "--install-tools", str(tmp_path))[0] == 0  # its own: replaced


def test_install_tools_never_writes_through_a_planted_symlink(tmp_path):
    # another user who can write the directory plants the temp file's name (and the
    # tool's) as symlinks to a file of ours; installing must write neither through them
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(mode=0o755)
    victim = tmp_path / "victim"
    victim.write_text("secret")
    victim.chmod(0o600)
    for name in ("neuron-ls", "neuron-top"):
        os.symlink(victim, bin_dir / f"{name}.{os.getpid()}.tmp")
    marked = tmp_path / "marked"
    marked.write_text(ls._TOOL_MARK + "\n")
    marked.chmod(0o600)
    os.symlink(marked, bin_dir / "neuron-ls")   # passes for one of ours by its content
    ls.install_tools(str(bin_dir))
    assert victim.read_text() == "secret" and victim.stat().st_mode & 0o777 == 0o600
    assert marked.read_text() == ls._TOOL_MARK + "\n" and marked.stat().st_mode & 0o777 == 0o600
    for name in ("neuron-ls", "neuron-top"):
        tool = bin_dir / name
        assert not tool.is_symlink() and tool.stat().st_mode & 0o777 == 0o755
        assert ls._TOOL_MARK in tool.read_text()


@pytest.mark.parametrize("mode, owner, refused", [
    (0o777, None, True), (0o775, None, True), (0o1777, None, False),
    (0o1777, 65534, True), (0o755, None, False),
], ids=["world-writable", "group-writable", "sticky-ours", "sticky-not-ours", "ours"])
def test_install_tools_refuses_a_directory_others_can_write(tmp_path, mode, owner, refused):
    from neuronmp.errors import UnsafeDirectoryError

    if owner is not None and os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    bin_dir.chmod(mode)
    if owner is not None:
        os.chown(bin_dir, owner, -1)
    if refused:
        with pytest.raises(UnsafeDirectoryError) as err:
            ls.install_tools(str(bin_dir))
        assert err.value.path == str(bin_dir) and oct(mode)[2:] in str(err.value)
        assert os.listdir(bin_dir) == []
    else:
        assert len(ls.install_tools(str(bin_dir))) == 3


def test_install_tools_under_umask_000_makes_no_world_writable_directory(tmp_path):
    target = tmp_path / "opt" / "neuron" / "bin"
    res = subprocess.run(
        ["sh", "-c", 'umask 000 && exec "$0" -m neuronmp.cli.ls --install-tools "$1"',
         sys.executable, str(target)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    for d in (tmp_path / "opt", tmp_path / "opt" / "neuron", target):
        assert d.stat().st_mode & 0o022 == 0, (d, oct(d.stat().st_mode))
    for name in ("neuron-ls", "neuron-top"):
        assert (target / name).stat().st_mode & 0o777 == 0o755
