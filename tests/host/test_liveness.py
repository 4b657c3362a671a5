"""neuronmp.host.liveness: only the kernel's word that an owner is dead lets a sweep delete.

Owners are real processes; the one in another PID namespace is started with
``unshare --user --map-root-user --pid --fork --mount-proc`` (its pids mean
nothing in our /proc, as for a container sharing the runtime directory).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from neuronmp.host import liveness, procid
from neuronmp.shm.segment import Segment, shm_dir, sweep

_OWNER = ("from neuronmp.shm.segment import Segment\nimport sys, time\n"
          "s = Segment.create(4096)\nprint(s.name, flush=True)\ntime.sleep(60)\n")


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    argv = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "true"]
    return subprocess.run(argv, capture_output=True).returncode == 0


def _names(directory):
    return sorted(os.listdir(directory))


def test_owner_in_another_pid_namespace_keeps_its_segment_until_it_dies(procs):
    if not _unshare_works():
        pytest.skip("unprivileged user + PID namespaces are not available here")
    owner = procs.popen(["unshare", "--user", "--map-root-user", "--pid", "--fork",
                         "--mount-proc", "--kill-child", sys.executable, "-c", _OWNER],
                        stdout=subprocess.PIPE, text=True)
    name = owner.stdout.readline().strip()
    who = liveness.owner_of(name)
    assert who is not None and who.pid == 1, name  # pid 1 of its own namespace
    assert not who.alive()  # so /proc here cannot tell: it is somebody else's pid 1
    assert liveness.state(who, shm_dir()) == liveness.ALIVE
    assert sweep() == []
    assert name in _names(shm_dir())
    owner.send_signal(signal.SIGKILL)  # --kill-child takes the owner along
    owner.wait(timeout=10)
    _wait_dead(who)
    assert sweep() == [name]
    assert _names(shm_dir()) == []  # its .live file went with it


def _wait_dead(who, timeout=5.0):
    import time

    deadline = time.monotonic() + timeout
    while liveness.state(who, shm_dir()) != liveness.DEAD:
        assert time.monotonic() < deadline, "the owner's lock outlived it"
        time.sleep(0.02)


def test_states_alive_dead_unknown(procs):
    mine = Segment.create(4096)
    me = procid.current()
    assert liveness.state(me, shm_dir()) == liveness.ALIVE
    child = procs.python(_OWNER)
    name = child.stdout.readline().strip()
    theirs = liveness.owner_of(name)
    assert liveness.state(theirs, shm_dir()) == liveness.ALIVE
    child.kill()
    child.wait(timeout=10)
    assert liveness.state(theirs, shm_dir()) == liveness.DEAD
    # a segment with no .live file beside it and no such process in our /proc: its owner
    # may live where we cannot see (fail closed), so it stays
    ghost = f"nmp-{theirs.pid}-{theirs.start + 1}-{'0' * 16}"
    open(os.path.join(shm_dir(), ghost), "wb").close()
    assert liveness.state(liveness.owner_of(ghost), shm_dir()) == liveness.UNKNOWN
    assert sweep() == [name]
    assert _names(shm_dir()) == sorted([ghost, mine.name, liveness.prefix(me) + ".live"])
    os.unlink(os.path.join(shm_dir(), ghost))
    mine.close()


def test_own_live_file_goes_when_the_last_segment_is_closed_and_released():
    seg = Segment.create(4096)
    live = liveness.live_path(procid.current(), shm_dir())
    assert os.path.exists(live) and liveness.holding() == [os.path.realpath(shm_dir())]
    liveness.release()
    assert os.path.exists(live), "released while a segment of ours remained"
    seg.close()
    liveness.release()
    assert not os.path.exists(live) and liveness.holding() == []


def test_forked_child_keeps_the_parents_lock_the_parents():
    seg = Segment.create(4096)
    me = procid.current()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0 if liveness.holding() == [] else 1
        liveness.release()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert liveness.state(me, shm_dir()) == liveness.ALIVE  # the child did not unlock it
    seg.close()
