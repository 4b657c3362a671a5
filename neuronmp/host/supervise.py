"""Stopping processes in stages, and saying how a process ended: one home for both.

    stop_in_stages(procs)
        ask every process to stop (a signal, a STOP message: the caller's ``ask``)
        ──▶ wait for all of them on ONE shared deadline (not one grace each)
        ──▶ SIGKILL (the caller's ``kill``) whoever is still running, then reap

The launcher stops its ranks this way, the pool its workers, the server its pool;
``describe_exit`` gives every error and summary the same wording for an exit
status, whether it came from subprocess (``-9``), multiprocessing (``-9``) or a
shell (``137``).  Imports no torch and nothing above the runtime layer.
"""
from __future__ import annotations

import signal
import time
from typing import Callable, List, Optional, Sequence, TypeVar

__all__ = ["describe_exit", "signal_name", "stop_in_stages"]

P = TypeVar("P")


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; the number itself for a signal Python does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def describe_exit(code: Optional[int]) -> str:
    """How a process ended, in words: ``exit code 3``, ``killed by signal SIGKILL``.

    ``code`` is a returncode as subprocess and multiprocessing give it (negative:
    the signal that killed it); None means the status is unknown.
    """
    if code is None:
        return "unknown exit status"
    if code < 0:
        return f"killed by signal {signal_name(-code)}"
    return f"exit code {code}"


def stop_in_stages(procs: Sequence[P], *, ask: Callable[[P], None],
                   running: Callable[[P], bool], kill: Callable[[P], None],
                   grace: float, poll: Optional[Callable[[float], None]] = None,
                   give_up: Optional[Callable[[], bool]] = None) -> List[P]:
    """Ask every process to stop, wait for all on one deadline, kill the rest.

    ``running(p)`` must also reap ``p`` when it has ended (so the check is honest);
    ``poll(seconds)`` sleeps between checks (default ``time.sleep``); ``give_up()``
    returning True ends the wait early (a second Ctrl-C).  Returns the processes
    that had to be killed.
    """
    sleep = poll or time.sleep
    for p in procs:
        ask(p)
    deadline = time.monotonic() + grace
    while any(running(p) for p in procs):
        left = deadline - time.monotonic()
        if left <= 0 or (give_up is not None and give_up()):
            break
        sleep(min(0.02, left))
    killed = [p for p in procs if running(p)]
    for p in killed:
        kill(p)
    return killed
