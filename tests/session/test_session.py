"""neuronmp.session.session: one owner per runtime of the pool, the core book and loaded models;
forked children never reach their parent's workers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import neuronmp
from neuronmp.host import runtime
from neuronmp.session import session

_FORK = textwrap.dedent("""
    import json, os, sys, torch, neuronmp
    from neuronmp.errors import CoreUnavailableError
    m = neuronmp.trace(torch.nn.Identity(), torch.zeros(4, 256))
    m(torch.zeros(4, 256))
    pid = os.fork()
    if pid == 0:
        if sys.argv[1] == "own":
            os.environ["NEURON_RT_VISIBLE_CORES"] = "1"
        wrong = calls = 0
        try:
            for i in range(300):
                x = torch.full((4, 256), float(-i - 1))
                wrong += not torch.equal(m(x), x)
                calls += 1
            out = {"calls": calls, "wrong": wrong, "cores": list(neuronmp.visible_cores())}
        except CoreUnavailableError as exc:
            out = {"calls": calls, "error": str(exc)}
        print(json.dumps(out), flush=True)
        sys.exit(0)   # a normal exit: atexit handlers run in the child too
    wrong = 0
    for i in range(2000):   # while the child calls too
        x = torch.full((4, 256), float(i))
        wrong += not torch.equal(m(x), x)
    _, status = os.waitpid(pid, 0)
    for i in range(50):     # the parent's workers outlive the child's exit
        x = torch.full((4, 256), float(i))
        wrong += not torch.equal(m(x), x)
    print(json.dumps({"wrong": wrong, "status": status, "pid": os.getpid()}), flush=True)
""")


@pytest.mark.parametrize("child", ["refused", "own"])
def test_a_forked_child_never_reaches_the_parents_workers(procs, emulated, child):
    emulated("1x2")
    env = dict(os.environ)
    if child == "own":
        env["NEURON_RT_VISIBLE_CORES"] = "0"
    proc = procs.popen([sys.executable, "-c", _FORK, child], env=env, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    kid, parent = lines
    assert parent["wrong"] == 0 and parent["status"] == 0
    if child == "refused":   # every core is the parent's: the child is refused, named
        assert kid["calls"] == 0
        assert f"held by pid {parent['pid']}" in kid["error"]
    else:                    # the child runs on a core of its own, with workers of its own
        assert kid == {"calls": 300, "wrong": 0, "cores": [1]}


def test_the_session_owns_the_pool_book_and_models_of_one_runtime(emulated):
    emulated("1x2")
    assert session.active() is None
    model = neuronmp.trace(torch.nn.Identity(), torch.zeros(2, 3))
    first = session.current()
    assert session.active() is first and first.runtime is runtime.get_runtime()
    assert first.book.usage() == (1, 0)
    pool = first.pool
    neuronmp.shutdown()   # the runtime's one shutdown hook closes the session
    assert first.closed and pool.closed and session.active() is None
    x = torch.rand(2, 3)
    assert torch.equal(model(x), x)   # loads again under a new runtime, same core
    second = session.current()
    assert second is not first and second.book.usage() == (1, 0)
    assert second.pool is not pool


def test_the_session_calls_a_core_and_reads_its_counters_handing_out_no_lower_names(emulated):
    emulated("1x2")
    s = session.current()
    assert s.core_stats() == []   # no model: no workers started for a look at them
    model = neuronmp.trace(torch.nn.Identity(), torch.zeros(2, 3))
    core, mid = session.current().loaded[neuronmp.session.model.model_of(model).handle].targets[0]
    x = torch.rand(2, 3)
    assert torch.equal(s.call(core, mid, (1, x)).result(timeout=30)[0], x)
    counts = {c.core: c.done for c in s.core_stats()}
    assert set(counts) == set(s.cores) and counts[core] >= 1   # ours, at least
    # the pool's and shared memory's names are imported from their own modules
    for name in ("LoopAnswer", "Timer", "StatsBlock", "Segment", "futex_waits", "Pool"):
        assert not hasattr(session, name), name
