"""neuronmp-run end to end: real launcher processes, real ranks, real core reservations.

Only two tests here import torch in their ranks or launcher (the gloo all_reduce
and the multi-host hand-off); the rest run plain-Python ranks so the file stays fast.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from neuronmp.launch import launcher

RUN = [sys.executable, "-m", "neuronmp.cli.run"]


def _script(tmp_path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _launch(procs, *args, env=None):
    full = dict(os.environ)
    full.update(env or {})
    return procs.popen([*RUN, *map(str, args)], env=full, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, timeout: float, what: str, *jobs):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for job in jobs:
            if job.poll() is not None:
                raise AssertionError(f"launcher exited {job.returncode} while waiting for "
                                     f"{what}: {job.stderr.read()}")
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _gone(pids, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.02)
    return False


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _tee_lines(stdout: str) -> dict:
    """{rank: [line, ...]} from the launcher's console, whose lines carry [rankN]: prefixes."""
    out: dict = {}
    for line in stdout.splitlines():
        if line.startswith("[rank"):
            rank, _, text = line.partition("]:")
            out.setdefault(int(rank[5:]), []).append(text)
    return out


# -- the main acceptance test: 4 ranks x 4 cores on inf1.6xlarge, gloo all_reduce ----------

GLOO_RANK = """
    import json, os
    import neuronmp
    from neuronmp.host import visibility
    rt = neuronmp.init()
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")   # env://: MASTER_ADDR/PORT, RANK, WORLD_SIZE
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT", "NEURON_RT_ROOT_COMM_ID", "OMP_NUM_THREADS",
            "NEURON_RT_VISIBLE_CORES", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"]
    print(json.dumps({"cores": list(rt.cores), "count": neuronmp.core_count(),
                      "nc0": visibility.local_to_global("nc:0", rt.cores),
                      "sum": t.item(), "env": {k: os.environ.get(k) for k in keys}}))
"""


def test_inf1_6xlarge_four_ranks_of_four_cores_all_reduce(procs, emulated, tmp_path):
    emulated("inf1.6xlarge")
    script = _script(tmp_path, "rank.py", GLOO_RANK)
    logs = tmp_path / "logs"
    job = _launch(procs, "--nproc-per-node", 4, "--cores-per-proc", 4, "--tee", 1,
                  "--log-dir", logs, "--rdzv-id", "job1", script)
    out, err = job.communicate(timeout=90)
    assert job.returncode == 0, err
    lines = _tee_lines(out)
    assert sorted(lines) == [0, 1, 2, 3]
    for rank, text in lines.items():
        got = json.loads(text[-1])
        assert got["cores"] == list(range(4 * rank, 4 * rank + 4)) and got["count"] == 4
        assert got["nc0"] == 4 * rank
        assert got["sum"] == 1 + 2 + 3 + 4
        env = got["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "4"
        assert env["GROUP_RANK"] == "0" and env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"].isdigit()
        assert env["NEURON_RT_ROOT_COMM_ID"] == "127.0.0.1:62182"
        assert env["OMP_NUM_THREADS"] == "4"
        assert env["NEURON_RT_VISIBLE_CORES"] == f"{4 * rank}-{4 * rank + 3}"
        assert env["TORCHELASTIC_RUN_ID"] == "job1"
        # torchrun's log tree, with the teed stream copied to the file unprefixed
        logged = (logs / "job1" / "attempt_0" / str(rank) / "stdout.log").read_text()
        assert json.loads(logged.splitlines()[-1]) == got


# -- failures, restarts ------------------------------------------------------------------------

FAILING_RANK = """
    import os, sys, time
    from neuronmp import record

    @record
    def main():
        fail_on = sys.argv[1]                 # attempt in which rank 1 fails, or "all"
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        print("attempt", attempt, "rank", os.environ["RANK"], flush=True)
        if os.environ["RANK"] == "1" and fail_on in (str(attempt), "all"):
            time.sleep(0.2)
            raise ValueError(f"rank 1 gave up on attempt {attempt}")
        time.sleep(float(sys.argv[2]))

    main()
"""


def test_one_rank_raising_stops_the_others_and_is_named(procs, tmp_path):
    script = _script(tmp_path, "fail.py", FAILING_RANK)
    start = time.monotonic()
    job = _launch(procs, "--nproc-per-node", 3, "--cores", "0-5", "--stop-timeout", 5,
                  script, 0, 60)
    out, err = job.communicate(timeout=30)
    assert job.returncode == 1
    assert time.monotonic() - start < 20  # the sleepers were stopped, not waited for
    assert "Root cause (first failing rank):" in err
    assert "rank       : 1 (local_rank 1)" in err
    assert "ValueError: rank 1 gave up on attempt 0" in err
    assert "cores      : 2-3" in err
    pid_line = next(ln for ln in err.splitlines() if ln.strip().startswith("pid "))
    assert pid_line.split(":")[1].strip().isdigit()
    assert "rank 0 (pid" in err and "rank 2 (pid" in err
    assert err.count("stopped by the launcher (was killed by signal SIGTERM)") == 2


def test_rank_killed_by_signal_is_reported_with_its_stderr(procs, tmp_path):
    script = _script(tmp_path, "die.py", """
        import os, signal, sys, time
        if os.environ["RANK"] == "0":
            print("about to die", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    job = _launch(procs, "--nproc-per-node", 2, "--redirects", 2, "--log-dir", tmp_path / "l",
                  script)
    _, err = job.communicate(timeout=30)
    assert job.returncode == 1
    assert "rank       : 0" in err and "exit code  : -9 (signal SIGKILL)" in err
    assert "<not recorded>" in err and "about to die" in err  # stderr tail from the log file
    assert "was killed by signal SIGKILL, so it raised nothing" in err
    assert "neuronmp.record" not in err   # no exception went unrecorded: no hint to record it


@pytest.mark.parametrize("how, hint", [
    ("sys.exit(3)", "ended with exit code 3 without raising an exception"),
    ("raise ValueError('bad shard')", "decorate the rank's entry point with neuronmp.record"),
])
def test_the_record_hint_appears_only_for_an_unrecorded_exception(procs, tmp_path, how, hint):
    script = _script(tmp_path, "end.py", f"""
        import sys
        {how}
    """)
    job = _launch(procs, "--nproc-per-node", 1, "--redirects", 2, "--log-dir", tmp_path / "l",
                  script)
    _, err = job.communicate(timeout=30)
    assert job.returncode == 1 and hint in err, err


def test_restart_whole_group_after_a_failure(procs, tmp_path):
    script = _script(tmp_path, "fail.py", FAILING_RANK)
    logs = tmp_path / "logs"
    job = _launch(procs, "--nproc-per-node", 2, "--max-restarts", 1, "--log-dir", logs,
                  "--rdzv-id", "r", "--tee", 1, script, 0, 0.1)
    out, err = job.communicate(timeout=30)
    assert job.returncode == 0, err
    assert "restarting all 2 rank(s) (restart 1 of 1)" in err
    lines = _tee_lines(out)
    assert lines[0] == ["attempt 0 rank 0", "attempt 1 rank 0"]  # the healthy rank restarted too
    assert lines[1] == ["attempt 0 rank 1", "attempt 1 rank 1"]
    error = json.loads((logs / "r" / "attempt_0" / "1" / "error.json").read_text())
    assert error["message"]["message"] == "ValueError: rank 1 gave up on attempt 0"
    assert not (logs / "r" / "attempt_1" / "1" / "error.json").exists()


def test_restarts_used_up_fail_the_job(procs, tmp_path):
    script = _script(tmp_path, "fail.py", FAILING_RANK)
    job = _launch(procs, "--nproc-per-node", 2, "--max-restarts", 1, script, "all", 0.1)
    _, err = job.communicate(timeout=30)
    assert job.returncode == 1
    assert "(attempt 2 of 2)" in err and "gave up on attempt 1" in err


# -- the launcher's own death ---------------------------------------------------------------

STUBBORN_RANK = """
    import os, signal, sys, time
    if os.environ["RANK"] == "0":  # must be SIGKILLed at the deadline
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    with open(os.path.join(sys.argv[1], "pid." + os.environ["RANK"]), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
"""


def _start_stubborn(procs, tmp_path, *extra):
    script = _script(tmp_path, "stubborn.py", STUBBORN_RANK)
    job = _launch(procs, "--nproc-per-node", 3, "--cores-per-proc", 1, *extra, script, tmp_path)
    files = [tmp_path / f"pid.{r}" for r in range(3)]
    _wait_for(lambda: all(f.exists() and f.read_text() for f in files), 30, "ranks to start",
              job)
    return job, [int(f.read_text()) for f in files]


def test_sigterm_to_launcher_stops_every_rank_within_the_deadline(procs, tmp_path):
    job, pids = _start_stubborn(procs, tmp_path, "--stop-timeout", 1)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=15)
    assert job.returncode == 128 + signal.SIGTERM
    assert "received SIGTERM, stopping 3 rank(s)" in err
    assert _gone(pids, 1.0), "ranks outlived the launcher"


def test_second_sigint_skips_the_deadline(procs, tmp_path):
    job, pids = _start_stubborn(procs, tmp_path, "--stop-timeout", 60)
    job.send_signal(signal.SIGINT)
    _wait_for(lambda: not _alive(pids[1]), 10, "the first SIGINT to reach the ranks", job)
    assert _alive(pids[0])  # rank 0 ignores the forwarded signal
    job.send_signal(signal.SIGINT)
    job.communicate(timeout=10)  # well before the 60 s deadline
    assert job.returncode == 128 + signal.SIGINT
    assert _gone(pids, 1.0)


def test_sigkill_to_launcher_takes_the_ranks_down(procs, tmp_path):
    job, pids = _start_stubborn(procs, tmp_path)
    job.kill()
    job.wait(timeout=10)
    assert _gone(pids, 2.0), "ranks survived their launcher's SIGKILL"


# -- several jobs on one host: reservations keep them apart ----------------------------------

HOLDING_RANK = """
    import os, sys, time
    import neuronmp
    from neuronmp import record

    @record
    def main():
        cores = neuronmp.init().cores
        ready = os.path.join(sys.argv[1], sys.argv[2] + "." + os.environ["RANK"])
        with open(ready, "w") as f:
            f.write(",".join(map(str, cores)) + " " + str(os.getpid()))
        go = os.path.join(sys.argv[1], "go")
        deadline = time.monotonic() + 60
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.02)

    main()
"""


def test_disjoint_jobs_share_the_host_overlapping_job_is_refused(procs, tmp_path):
    script = _script(tmp_path, "hold.py", HOLDING_RANK)
    a = _launch(procs, "--nproc-per-node", 2, "--cores", "0-3", script, tmp_path, "a")
    b = _launch(procs, "--nproc-per-node", 2, "--cores", "4-7", script, tmp_path, "b")
    ready = [tmp_path / f"{job}.{r}" for job in "ab" for r in range(2)]
    _wait_for(lambda: all(f.exists() and f.read_text() for f in ready), 30,
              "both jobs to reserve their cores", a, b)
    held = {f.name: f.read_text().split() for f in ready}
    assert [held[n][0] for n in ("a.0", "a.1", "b.0", "b.1")] == ["0,1", "2,3", "4,5", "6,7"]
    # both jobs hold their cores at once; a third job wanting 2-5 collides with both
    c = _launch(procs, "--nproc-per-node", 2, "--cores", "2-5", script, tmp_path, "c")
    _, err = c.communicate(timeout=30)
    assert c.returncode == 1
    assert "CoreUnavailableError: NeuronCore(s) not available" in err
    holder = held["a.1"][1] if "Requested:nc2-nc3" in err else held["b.0"][1]
    assert f"held by pid {holder}" in err
    (tmp_path / "go").write_text("")
    for job in (a, b):
        _, err = job.communicate(timeout=30)
        assert job.returncode == 0, err


# -- the rest of the command line ----------------------------------------------------------

def test_module_no_python_and_user_omp_threads(procs, tmp_path):
    (tmp_path / "mymod.py").write_text(
        "import os; print(os.environ['NEURON_RT_VISIBLE_CORES'], os.environ['OMP_NUM_THREADS'])")
    job = _launch(procs, "--cores", "8-11", "--nproc-per-node", "auto", "--cores-per-proc", 2,
                  "-t", 1, "-m", "mymod", env={"PYTHONPATH": str(tmp_path),
                                               "OMP_NUM_THREADS": "7"})
    out, err = job.communicate(timeout=30)
    assert job.returncode == 0, err
    assert _tee_lines(out) == {0: ["8-9 7"], 1: ["10-11 7"]}
    job = _launch(procs, "--no-python", "--cores", "3", "-t", 1, "sh", "-c",
                  "echo $NEURON_RT_VISIBLE_CORES $LOCAL_RANK")
    out, err = job.communicate(timeout=30)
    assert job.returncode == 0, err
    assert _tee_lines(out) == {0: ["3 0"]}


def test_options_from_environment_command_line_wins(procs, tmp_path):
    script = _script(tmp_path, "p.py", "import os; print(os.environ['NEURON_RT_VISIBLE_CORES'])")
    env = {"NEURONMP_RUN_CORES": "0-3", "PET_NPROC_PER_NODE": "2", "PET_TEE": "1",
           "NEURON_RT_VISIBLE_CORES": "12-15"}
    job = _launch(procs, script, env=env)
    out, err = job.communicate(timeout=30)
    assert job.returncode == 0, err
    assert _tee_lines(out) == {0: ["0-1"], 1: ["2-3"]}
    job = _launch(procs, "--nproc-per-node", 4, script, env=env)
    out, err = job.communicate(timeout=30)
    assert _tee_lines(out) == {r: [str(r)] for r in range(4)}
    # no --cores: the launcher's own NEURON_RT_VISIBLE_CORES bounds the job
    del env["NEURONMP_RUN_CORES"]
    job = _launch(procs, script, env=env)
    out, err = job.communicate(timeout=30)
    assert _tee_lines(out) == {0: ["12-13"], 1: ["14-15"]}


@pytest.mark.parametrize("args,needle", [
    (["--nproc-per-node", "3"], "16 core(s) (0-15, all cores of 4x4) do not divide evenly "
                                "among 3 processes (16 = 3 x 5 + 1)"),
    (["--nproc-per-node", "17"], "17 processes need at least one core each but the job has "
                                 "16 core(s)"),
    (["--nproc-per-node", "5", "--cores-per-proc", "4"], "5 processes x 4 cores = 20 cores, "
                                                        "but the job has 16 core(s)"),
    (["--cores", "0-6", "--cores-per-proc", "2"], "does not divide into slices of 2 "
                                                  "(7 = 3 x 2 + 1)"),
    (["--cores", "3,5"], "--cores '3,5' is refused"),
    (["--nproc-per-node", "x"], "--nproc-per-node 'x' is not a whole number"),
    (["--tee", "5"], "Invalid --tee='5'"),
    (["-m", "--no-python"], "cannot be used together"),
])
def test_bad_layouts_refused_before_anything_starts(procs, tmp_path, args, needle):
    marker = tmp_path / "started"
    script = _script(tmp_path, "s.py", f"open({str(marker)!r}, 'w').close()")
    job = _launch(procs, *args, script)
    _, err = job.communicate(timeout=30)
    assert job.returncode == 2
    assert needle in err
    assert not marker.exists()


def test_launcher_imports_no_torch(procs):
    code = "import sys, neuronmp.cli.run, neuronmp.launch.launcher; print('torch' in sys.modules)"
    assert procs.python(code).communicate(timeout=30)[0].strip() == "False"


def test_plan_and_stream_parsing():
    assert launcher.plan_slices(range(4, 12), None, 2) == [(4, 5), (6, 7), (8, 9), (10, 11)]
    assert launcher.plan_slices(range(16), 2, None) == [tuple(range(8)), tuple(range(8, 16))]
    assert launcher.plan_slices(range(16), 2, 3) == [(0, 1, 2), (3, 4, 5)]
    assert launcher.parse_std_streams("3") == {None: 3}
    assert launcher.parse_std_streams("0:1,1:2") == {0: 1, 1: 2}
    assert launcher.root_comm_id("fe80::1") == "[fe80::1]:62182"


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    # a port from the ephemeral range can be taken by any connection's local end
    # before the job's store binds it; below it only an explicit bind lands
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        start = int(f.read().split()[0])
    ports = {launcher.free_port() for _ in range(20)}
    assert all(10000 <= p < start for p in ports), sorted(ports)
    assert len(ports) > 1   # picked at random, not one port for every job
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
