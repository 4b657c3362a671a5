"""Process identity: a process is (pid, start time), never a pid alone.

Pids are reused; a holder file or a ring peer recorded as a bare pid could
point at an unrelated process later.  The start time (clock ticks since boot,
field 22 of /proc/<pid>/stat) tells the two apart, and reading it costs one
small file read, cheap enough to do at every wait timeout.
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional


class ProcId(NamedTuple):
    pid: int
    start: int  # clock ticks since boot, as the kernel reports it

    def alive(self) -> bool:
        return start_time(self.pid) == self.start


def start_time(pid: int) -> Optional[int]:
    """The kernel's start time of ``pid``, or None when no such process (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    fields = data[data.rindex(b")") + 2:].split()
    if fields[0] == b"Z":  # a zombie has exited; only its exit status remains
        return None
    return int(fields[19])


_me: Optional[ProcId] = None


def current() -> ProcId:
    """This process's identity (read once per process: a forked child has a new pid)."""
    global _me
    me, pid = _me, os.getpid()
    if me is not None and me.pid == pid:
        return me
    start = start_time(pid)
    assert start is not None
    _me = ProcId(pid, start)
    return _me


def of(pid: int) -> Optional[ProcId]:
    """The identity of a running process, or None."""
    start = start_time(pid)
    return None if start is None else ProcId(pid, start)


def cmdline(pid: int, limit: int = 200) -> str:
    """The command line of ``pid`` as one string ('' when unreadable)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:limit]


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid``, to the nanosecond where the kernel keeps
    schedstat (``cpu_times`` counts 10 ms ticks: over one second, 32 workers that
    each use half a millisecond would read as 0 or 10 ms each)."""
    try:
        total = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        import psutil  # only where schedstat is missing

        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
