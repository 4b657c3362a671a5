"""neuronmp-ls: inventory and holders, without ever taking a lock."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading

from neuronmp import reservation, topology
from neuronmp.cli import ls
from neuronmp.visibility import Request

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
