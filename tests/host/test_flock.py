"""neuronmp.host.flock: the kernel semantics core reservations rely on, with real processes.

Every check of "is it held" is made from another open file description (a fresh
os.open), the way another process sees the lock.
"""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time

import pytest

from neuronmp.host.flock import Flock

# A separate process that takes the lock, says so, then waits for a line on stdin
# (or is killed).  "fork" makes it fork a child that keeps its inherited copy; "exec"
# makes it start an exec'd child with close_fds=False.
HOLDER = r"""
import os, subprocess, sys, time
from neuronmp.host.flock import Flock
lock = Flock.try_acquire(sys.argv[1])
assert lock is not None
if sys.argv[2] == "exec":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             close_fds=False)
    print(child.pid, flush=True)
elif sys.argv[2] == "fork":
    pid = os.fork()
    if pid == 0:
        time.sleep(60)  # keeps the inherited descriptor open, never forgets it
        os._exit(0)
    print(pid, flush=True)
else:
    print(os.getpid(), flush=True)
sys.stdin.readline()
"""


def is_held(path: str) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "nc0.lock")


def start_holder(procs, path, mode="plain"):
    p = procs.popen([sys.executable, "-c", HOLDER, path, mode], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.strip().isdigit(), p.communicate(timeout=10)
    return p, int(line)


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} still alive")


def test_try_acquire_is_exclusive_and_release_frees(path):
    lock = Flock.try_acquire(path)
    assert lock is not None and lock.held and is_held(path)
    assert Flock.try_acquire(path) is None  # another description, even in this process
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert not os.get_inheritable(lock.fileno())
    lock.release()
    assert not lock.held and not is_held(path)
    lock.release()  # idempotent
    with pytest.raises(ValueError, match="not held"):
        lock.fileno()


def test_missing_file_without_create_and_symlink_refused(path, tmp_path):
    with pytest.raises(FileNotFoundError):
        Flock.try_acquire(path, create=False)
    assert not os.path.exists(path)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, path)
    with pytest.raises(OSError):  # O_NOFOLLOW: never a lock on a planted link's target
        Flock.try_acquire(path)


def test_acquire_times_out_then_gets_the_lock_once_released(procs, path):
    holder, _ = start_holder(procs, path)
    t0 = time.monotonic()
    assert Flock.acquire(path, timeout=0.2) is None
    assert time.monotonic() - t0 >= 0.2
    holder.stdin.write("\n")
    holder.stdin.flush()
    lock = Flock.acquire(path, timeout=30)  # the holder's exit frees it within the wait
    assert lock is not None and holder.wait(timeout=10) == 0
    lock.release()


def test_sigkilled_holder_frees_the_lock_at_once(procs, path):
    holder, _ = start_holder(procs, path)
    assert is_held(path) and Flock.try_acquire(path) is None
    holder.kill()
    holder.wait(timeout=10)
    lock = Flock.try_acquire(path)  # no waiting
    assert lock is not None
    lock.release()


def test_forked_child_closing_or_releasing_keeps_the_parents_lock(path):
    lock = Flock.try_acquire(path)
    try:
        for how in ("forget", "release", "close"):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    if how == "close":
                        os.close(lock.fileno())
                    else:
                        getattr(lock, how)()
                    code = 0 if (how == "close" or not lock.held) else 2
                finally:
                    os._exit(code)
            assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
            assert is_held(path), how
            assert lock.held
    finally:
        lock.release()
    assert not is_held(path)


def test_parent_release_frees_even_while_a_forked_child_keeps_its_copy(procs, path):
    """release() unlocks explicitly: a child that never forgot its copy cannot keep it."""
    lock = Flock.try_acquire(path)
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    try:
        lock.release()
        assert not is_held(path)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_forget_leaves_a_reused_descriptor_number_alone(path, tmp_path):
    lock = Flock.try_acquire(path)
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                number = lock.fileno()
                os.close(number)
                other = os.open(str(tmp_path / "other"), os.O_RDWR | os.O_CREAT)
                assert other == number  # the lowest free number is reused
                lock.forget()
                os.fstat(other)  # still open: forget() saw it is another file
                code = 0
            finally:
                os._exit(code)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert is_held(path)
    finally:
        lock.release()


@pytest.mark.parametrize("mode", ["exec", "fork"])
def test_holders_death_frees_the_lock_while_its_child_lives_only_after_exec(procs, path, mode):
    """An exec'd child (close_fds=False) never inherits the lock; a forked one that
    keeps its copy does (that is why the reservation layer forgets at fork)."""
    holder, child_pid = start_holder(procs, path, mode)
    try:
        assert is_held(path)
        holder.kill()
        holder.wait(timeout=10)
        os.kill(child_pid, 0)  # the child outlives its parent for this check
        assert is_held(path) == (mode == "fork")
    finally:
        os.kill(child_pid, signal.SIGKILL)
        wait_gone(child_pid)
    assert not is_held(path)


def test_exec_child_does_not_hold_and_parent_keeps_the_lock(procs, path):
    lock = Flock.try_acquire(path)
    try:
        probe = (
            "import fcntl, os, sys\n"
            "fds = '/proc/self/fd'\n"
            "for n in os.listdir(fds):\n"
            "    try:\n"
            "        if os.readlink(os.path.join(fds, n)) == sys.argv[1]:\n"
            "            sys.exit(8)  # the lock descriptor crossed exec\n"
            "    except OSError:\n"
            "        pass\n"
            "fd = os.open(sys.argv[1], os.O_RDWR)\n"
            "try:\n"
            "    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
            "except BlockingIOError:\n"
            "    sys.exit(7)\n"
        )
        child = procs.popen([sys.executable, "-c", probe, path], close_fds=False)
        assert child.wait(timeout=30) == 7  # held, by the parent, seen from the exec'd child
        assert is_held(path) and lock.held  # the child's exit took nothing with it
    finally:
        lock.release()


def test_linked_tells_an_unlinked_or_replaced_file(path):
    lock = Flock.try_acquire(path)
    try:
        assert lock.linked()
        os.unlink(path)
        assert not lock.linked()
        open(path, "w").close()  # a new file at the same name is not the one we hold
        assert not lock.linked()
    finally:
        lock.release()
