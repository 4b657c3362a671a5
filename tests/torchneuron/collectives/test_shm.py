"""The shared-memory engine's faults: a rank SIGKILLed mid-collective, a rank that
never comes; ranks are real processes (env:// rendezvous), not torchrun's workers, so
nothing but the engine stops the survivor."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest
from torchneuron_support import env_with

from neuronmp.host import leftovers
from neuronmp.launch import launcher
from neuronmp.shm.segment import sweep

pytestmark = pytest.mark.timeout(900)

RANK = """
    import json, os, signal, sys, threading, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from neuronmp.errors import (CollectiveRankDiedError, CollectiveTimeoutError,
                                 CollectiveUsageError)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    dist.init_process_group("neuron", timeout=timedelta(seconds=float(sys.argv[1])))
    rank = dist.get_rank()
    grow = rank if sys.argv[2] == "mismatch" else 0
    t = torch.ones((4 << 20) + grow, device="neuron")  # 16 MiB: several rounds each
    out = torch.empty(2 * t.numel(), device="neuron")  # all_gather: read in place
    op = getattr(dist, sys.argv[3])
    half = torch.empty(t.numel() // 2, device="neuron")  # reduce_scatter: read in place
    args = {"all_reduce": (t,), "all_gather_into_tensor": (out, t),
            "reduce_scatter_tensor": (half, t)}[sys.argv[3]]
    if rank == 1 and sys.argv[2] == "kill":
        # dies inside the collectives, whatever round it is in
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    if rank == 1 and sys.argv[2] == "absent":
        time.sleep(120)
    try:
        for _ in range(100000):
            op(*args)
    except (CollectiveRankDiedError, CollectiveTimeoutError, CollectiveUsageError) as exc:
        fields = {f: getattr(exc, f) for f in exc._fields}
        print(json.dumps({"error": type(exc).__name__, "fields": fields, "msg": str(exc)}),
              flush=True)
        dist.destroy_process_group()
        sys.exit(3)
"""


def _start(procs, tmp_path, timeout_s, mode, op="all_reduce"):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK))
    port = str(launcher.free_port())
    ranks = []
    for rank in (0, 1):
        env = env_with(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        ranks.append(procs.popen([sys.executable, str(script), str(timeout_s), mode, op],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, cwd="/"))
    return ranks


@pytest.mark.parametrize("op", ["all_reduce", "all_gather_into_tensor",
                                "reduce_scatter_tensor"])
def test_a_rank_killed_mid_collective_fails_the_other_naming_it(procs, tmp_path, runtime_dir,
                                                                 op):
    # the group's timeout is long: the survivor must learn of the death from the
    # peer's liveness, not by timing out; all_gather reads the peer's memory in place,
    # and all_reduce and reduce_scatter map its tensors, so the death may show there first
    r0, r1 = _start(procs, tmp_path, 600, "kill", op)
    out, err = r0.communicate(timeout=120)
    r1.communicate(timeout=60)
    assert r1.returncode == -signal.SIGKILL
    assert r0.returncode == 3, err[-3000:]
    fact = json.loads(out.strip().splitlines()[-1])
    assert fact["error"] == "CollectiveRankDiedError"
    assert fact["fields"] == {"rank": 1, "pid": r1.pid, "op": op}
    assert f"Rank 1 (pid {r1.pid})" in fact["msg"] and op in fact["msg"]
    # the group's segment was unlinked once every rank had mapped it; what the dead
    # rank left (its liveness file) the survivor swept when it found it dead
    assert leftovers.segments(runtime_dir) == []
    shm = os.path.join(runtime_dir, "shm")
    assert not os.path.isdir(shm) or os.listdir(shm) == []


def test_ranks_whose_all_gather_inputs_differ_in_size_both_fail_naming_the_sizes(
        procs, tmp_path):
    # read in place, a peer's input of another size would be read past its end: every
    # rank compares the sizes the others posted before reading anything
    ranks = _start(procs, tmp_path, 60, "mismatch", "all_gather_into_tensor")
    for proc in ranks:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 3, err[-3000:]
        fact = json.loads(out.strip().splitlines()[-1])
        assert fact["error"] == "CollectiveMismatchError"
        assert fact["fields"]["op"] == "all_gather_into_tensor"
        # each names every rank's call, the same on both
        assert fact["fields"]["differ"] == [1]
        assert [s["numel"] for s in fact["fields"]["sent"]] == [4 << 20, (4 << 20) + 1]
        assert f"rank 1 all_gather_into_tensor of {(4 << 20) + 1} x torch.float32" in \
            fact["msg"]


def test_a_rank_that_never_calls_times_out_naming_it(procs, tmp_path):
    r0, r1 = _start(procs, tmp_path, 3, "absent")
    out, err = r0.communicate(timeout=120)
    r1.kill()
    r1.communicate(timeout=60)
    assert r0.returncode == 3, err[-3000:]
    fact = json.loads(out.strip().splitlines()[-1])
    assert fact["error"] == "CollectiveTimeoutError"
    assert fact["fields"] == {"op": "all_reduce", "missing": [1], "timeout": 3.0}


@pytest.mark.parametrize("value", ["huge", "-5", "32", "2097152"])
def test_a_bad_slot_size_is_a_config_error_naming_it(monkeypatch, value):
    from neuronmp.errors import ConfigError
    from neuronmp.torchneuron.collectives import shm

    monkeypatch.setenv("NEURONMP_COLLECTIVE_SLOT_KB", value)
    with pytest.raises(ConfigError, match=f"NEURONMP_COLLECTIVE_SLOT_KB.*{value}"):
        shm.slot_bytes()
    monkeypatch.setenv("NEURONMP_COLLECTIVE_SLOT_KB", "64")
    assert shm.slot_bytes() == 64 << 10


SKEWED = """
    import json, os, random, signal, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from neuronmp.errors import CollectiveRankDiedError, CollectiveTimeoutError
    from neuronmp.shm import _waits
    from neuronmp.torchneuron.collectives import pieces, shm as engine
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    timeout = float(sys.argv[3])
    dist.init_process_group("neuron", timeout=timedelta(seconds=timeout))
    other = dist.new_group(backend="gloo")   # ranks leave its barrier apart
    rank, world = dist.get_rank(), dist.get_world_size()
    # 64 KiB: one arrival a call; 16 MiB: shareable, each rank writes into its peers'
    t = torch.ones(int(sys.argv[1]) // 4, device="neuron")
    shm = dist.group.WORLD._shm
    mode, pause = sys.argv[2], random.Random(rank)

    def die():
        print(json.dumps({"killed_at": time.time()}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def reduce_and_die(*args):
        # inside the reduction its peers wait for, its ticket drawn
        if mode == "stopping":
            os.kill(os.getpid(), signal.SIGSTOP)   # alive, and never done
        die()

    def claim_and_die(counters, mm, addrs, nelem, piece, code):
        # a mapped all_reduce: a piece claimed, never counted done.  Peers woken
        # first may have claimed every piece already: its check-in would then
        # complete their call, and it would die after the all_reduce, not inside it
        claimed = _waits.fetch_add(mm, counters.claims, 1) - counters.base
        if claimed < -(-nelem // piece):
            _waits.fetch_add(mm, counters.done, 1)
        reduce_and_die()

    try:
        for i in range(100000):
            dist.barrier(group=other)
            time.sleep(pause.choice([0, 0, 50e-6, 1e-3]))
            if rank == world - 1 and i == 50:
                if mode == "arriving":
                    # past the barrier its peers passed too: they are in the
                    # all_reduce, spinning for it, when it dies
                    die()
                time.sleep(0.2)   # the last to arrive: it reduces for everyone
                engine._reduce_into = reduce_and_die
                pieces.Counters.run = claim_and_die
            dist.all_reduce(t)
    except (CollectiveRankDiedError, CollectiveTimeoutError) as exc:
        fields = {f: getattr(exc, f) for f in exc._fields}
        print(json.dumps({"fields": fields, "error": type(exc).__name__,
                          "caught": shm.waits_caught,
                          "slept": shm.waits_slept, "failed_at": time.time()}), flush=True)
        dist.destroy_process_group()
        sys.exit(3)
"""


@pytest.mark.parametrize("nbytes,mode", [(64 << 10, "arriving"), (16 << 20, "arriving"),
                                         (64 << 10, "reducing"), (16 << 20, "reducing")])
@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_killed_while_its_peers_spin_for_it_fails_them_naming_it(
        procs, tmp_path, runtime_dir, world, nbytes, mode):
    # a spin far longer than the liveness checks' slices: the survivors must still
    # learn of the death (the spin is bounded, then they sleep and check), whether the
    # rank died before it arrived or as the last to arrive, reducing for the others
    # (every peer has drawn its ticket then: only its liveness tells)
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(SKEWED))
    port, timeout = str(launcher.free_port()), 120
    ranks = [procs.popen([sys.executable, str(script), str(nbytes), mode, str(timeout)],
                         env=env_with(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                      MASTER_PORT=port, NEURONMP_COLLECTIVE_SPIN_US="100000"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
             for r in range(world)]
    dead = ranks[-1]
    out, _ = dead.communicate(timeout=300)
    assert dead.returncode == -signal.SIGKILL
    killed_at = json.loads(out.strip().splitlines()[-1])["killed_at"]
    for proc in ranks[:-1]:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 3, err[-3000:]
        fact = json.loads(out.strip().splitlines()[-1])
        assert fact["fields"] == {"rank": world - 1, "pid": dead.pid, "op": "all_reduce"}
        # from the liveness checks between sleeps, long before the group's timeout
        assert fact["failed_at"] - killed_at < timeout / 4, fact
        # the wait for the dead rank outlasted its spin and slept (where the liveness
        # checks run); every wait is counted once, caught by the spin or not
        assert fact["slept"] >= 1 and fact["caught"] >= 0
    # nothing left behind: every rank exited by itself, no process of the job runs on,
    # no segment stays in the runtime directory
    assert all(proc.poll() is not None for proc in ranks)
    assert [p.pid for p in psutil.Process().children(recursive=True)
            if str(script) in " ".join(_cmdline(p))] == []
    assert leftovers.segments(runtime_dir) == []
    shm = os.path.join(runtime_dir, "shm")
    assert not os.path.isdir(shm) or os.listdir(shm) == []


@pytest.mark.parametrize("nbytes", [64 << 10, 16 << 20])
def test_a_last_rank_stopped_in_its_reduction_times_its_peers_out_naming_it(
        procs, tmp_path, runtime_dir, nbytes):
    # every peer drew its ticket and the last rank is alive, but never completes the
    # arrival (64 KiB) or the piece it claimed (16 MiB, mapped): a timeout naming the
    # rank they wait for, not an empty list of the missing
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(SKEWED))
    port, world = str(launcher.free_port()), 3
    ranks = [procs.popen([sys.executable, str(script), str(nbytes), "stopping", "3"],
                         env=env_with(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                      MASTER_PORT=port),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
             for r in range(world)]
    for proc in ranks[:-1]:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 3, err[-3000:]
        fact = json.loads(out.strip().splitlines()[-1])
        assert fact["error"] == "CollectiveTimeoutError"
        assert fact["fields"] == {"op": "all_reduce", "missing": [world - 1], "timeout": 3.0}
    ranks[-1].kill()
    ranks[-1].communicate(timeout=60)
    # the peers left before it died: what it held goes with the next sweep (the next
    # runtime's start-up, or neuronmp tidy)
    sweep()
    assert leftovers.segments(runtime_dir) == []


def _cmdline(proc) -> list:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


REINIT = """
    import json, sys, time
    import torch, torch.distributed as dist
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    sums = []
    for again in (False, True):
        if again and rank == 0:
            time.sleep(2)   # rank 1 looks for the new group's segment first
        dist.init_process_group("neuron", store=store, rank=rank, world_size=2)
        t = torch.ones(4, device="neuron")
        dist.all_reduce(t)
        sums.append(t.cpu().tolist())
        dist.destroy_process_group()
    print(json.dumps(sums))
"""


def test_a_group_made_again_on_the_same_store_finds_its_own_segment(procs, tmp_path):
    # a forked test run makes the default group once per test on torchrun's one store,
    # under the same prefix each time: the second group's ranks meet in a segment of its
    # own, not the name the first (closed) one left in the store
    for fact in _ranks(procs, tmp_path, REINIT):
        assert fact == [[2.0] * 4, [2.0] * 4]


def _ranks(procs, tmp_path, source: str, *args: str, world: int = 2, **env) -> list:
    """Run ``source`` as ranks 0 .. world - 1 (argv: rank, a free port, the world,
    ``args``; ``env`` added to each rank's); each rank's last line of output, read
    as JSON, once all exited cleanly."""
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(source))
    port = str(launcher.free_port())
    ranks = [procs.popen([sys.executable, str(script), str(rank), port, str(world), *args],
                         env=env_with(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                                      **env),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
             for rank in range(world)]
    facts = []
    for proc in ranks:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        facts.append(json.loads(out.strip().splitlines()[-1]))
    return facts


FAILING = """
    import json, sys, time
    import torch, torch.distributed as dist
    from neuronmp.torchneuron.collectives import shm as engine
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("neuron", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    t = torch.full((16,), float(rank + 1), device="neuron")   # one round: the last reduces

    def broken(*args):
        raise MemoryError(f"rank {rank} has no memory for the reduction")
    engine._reduce_into = broken   # whichever arrives last reduces for both: it raises
    if rank == 1:
        time.sleep(1.0)   # as a rule the last
    try:
        dist.all_reduce(t)
        print(json.dumps({"returned": t.cpu().tolist()}))
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
    dist.destroy_process_group()
"""


def test_a_reduction_that_fails_on_the_last_rank_fails_its_peers_too(procs, tmp_path):
    # the last rank to arrive reduces for everyone: if that raises, a peer must not
    # copy out the unreduced slot as its answer (it would return rank 1's input)
    facts = _ranks(procs, tmp_path, FAILING)
    last = 0 if facts[0].get("error") == "MemoryError" else 1
    assert facts[last] == {"error": "MemoryError",
                           "message": f"rank {last} has no memory for the reduction"}
    first = facts[1 - last]
    assert first.get("error") == "CollectiveMismatchError", first   # not a sum
    assert f"rank {last} has no memory for the reduction" in first["message"], first


FAILING_BETWEEN = """
    import json, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from torch.distributed import ReduceOp
    from neuronmp.torchneuron.collectives import group
    rank, port, world, case = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    # long enough that a peer left waiting for it fails the test's own timeout first
    dist.init_process_group("neuron", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=240))
    dtype = torch.float16 if case == "mapped_split" else torch.float32
    numel = {"rounds": 64 << 10, "mapped_split": 1 << 20, "mapped_scatter": 1 << 20,
             "exchange": 64 << 10}[case]
    t = torch.full((numel,), float(rank + 1), dtype=dtype, device="neuron")
    half = torch.empty(numel // world, dtype=dtype, device="neuron")

    def broken(a, b, out=None):
        raise MemoryError(f"rank {rank} has no memory for the reduction")
    if rank == 1:   # its share of the reduction raises, between two of the call's arrivals
        summed = group._FNS[int(ReduceOp.SUM)]
        group._REDUCERS.clear()
        group._FNS[int(ReduceOp.SUM)] = broken
    try:
        if case in ("mapped_scatter", "exchange"):
            dist.reduce_scatter_tensor(half, t)
        else:
            dist.all_reduce(t)
        fact = {"returned": True}
    except Exception as exc:
        fact = {"error": type(exc).__name__, "message": str(exc)}
    if rank == 1:
        group._REDUCERS.clear()
        group._FNS[int(ReduceOp.SUM)] = summed
    after = torch.ones(8, device="neuron")   # the group goes on: the ranks still agree
    dist.all_reduce(after)
    fact["after"] = after.cpu().tolist()
    print(json.dumps(fact))
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("case, world", [
    ("rounds", 2),           # the segment's rounds, each rank reducing all of one
    ("rounds", 3),           # the segment's rounds, each rank its share, then a copy-out
    ("mapped_split", 2),     # float16 mapped: the fixed split written into every tensor
    ("mapped_scatter", 2),   # reduce_scatter reading the peers' mapped inputs
    ("exchange", 2),         # reduce_scatter through the segment's rounds
])
def test_a_reduction_that_fails_between_arrivals_fails_its_peers_at_the_next(
        procs, tmp_path, case, world):
    # the peers wait for the failing rank at the call's next arrival: it makes that
    # arrival as a refusal naming its error, so they raise it there and then, not the
    # group's timeout (CollectiveTimeoutError) minutes later
    facts = _ranks(procs, tmp_path, FAILING_BETWEEN, case, world=world,
                       NEURONMP_COLLECTIVE_SLOT_KB="64")
    assert facts[1] == {"error": "MemoryError", "after": [float(world)] * 8,
                        "message": "rank 1 has no memory for the reduction"}, facts
    for fact in facts[:1] + facts[2:]:
        assert fact["error"] == "CollectiveMismatchError", fact
        assert "its reduction failed: MemoryError: rank 1 has no memory" in fact["message"]
        assert fact["after"] == [float(world)] * 8, fact


SLOW_COMPARE = """
    import json, sys, time
    import torch, torch.distributed as dist
    from neuronmp.torchneuron.collectives import arrivals
    rank, port, world = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("neuron", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    if rank == 0:   # woken by the barrier's completion, it compares the calls late
        compare = arrivals.Arrivals._compare
        def slow(self, gen, op):
            if op == "barrier":
                time.sleep(1.0)
            compare(self, gen, op)
        arrivals.Arrivals._compare = slow
    else:
        time.sleep(0.5)   # the last to the barrier: it completes it and goes on at once
    fact = {}
    dist.barrier()
    try:   # refused at once on every rank (a CPU tensor), without waiting for the peers
        dist.all_reduce(torch.ones(4))
    except Exception as exc:
        fact["refused"] = type(exc).__name__
    t = torch.ones(4, device="neuron")
    dist.all_reduce(t)   # its call must not overwrite the barrier's before rank 0 read it
    fact["sum"] = t.cpu().tolist()
    print(json.dumps(fact))
    dist.destroy_process_group()
"""


def test_the_arrival_after_a_refusal_waits_for_a_peer_still_comparing_the_one_before(
        procs, tmp_path):
    # a refusal arrives without waiting; the arrival after it writes the call area of
    # the arrival before it, which rank 0 (slow to wake) had not compared yet: it saw
    # rank 1's all_reduce there and raised CollectiveMismatchError at its barrier
    for fact in _ranks(procs, tmp_path, SLOW_COMPARE):
        assert fact == {"refused": "CollectiveUsageError", "sum": [2.0] * 4}, fact
