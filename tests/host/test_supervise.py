"""neuronmp.host.supervise: staged stop with one shared deadline, one exit wording."""
import signal
import subprocess
import sys
import time

import pytest

from neuronmp.host.supervise import describe_exit, stop_in_stages

_OBEYS = "import time\nwhile True: time.sleep(0.01)"
_IGNORES = ("import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('ready', flush=True)\nwhile True: time.sleep(0.01)")


@pytest.mark.parametrize("code, words", [
    (0, "exit code 0"), (3, "exit code 3"), (-9, "killed by signal SIGKILL"),
    (-15, "killed by signal SIGTERM"), (-200, "killed by signal 200"),
    (None, "unknown exit status"),
])
def test_one_wording_for_every_exit_status(code, words):
    assert describe_exit(code) == words


def test_one_shared_deadline_then_sigkill_for_whoever_ignores_the_ask(procs):
    obeys = [procs.popen([sys.executable, "-c", _OBEYS]) for _ in range(2)]
    stubborn = [procs.popen([sys.executable, "-c", _IGNORES], stdout=subprocess.PIPE,
                            text=True) for _ in range(2)]
    for p in stubborn:
        assert p.stdout.readline().strip() == "ready"
    gone = procs.popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    everyone = obeys + stubborn + [gone]
    t0 = time.monotonic()
    killed = stop_in_stages(everyone, ask=lambda p: p.send_signal(signal.SIGTERM),
                            running=lambda p: p.poll() is None,
                            kill=lambda p: (p.kill(), p.wait(10)), grace=1.0)
    took = time.monotonic() - t0
    assert killed == stubborn                       # only those that ignored the ask
    assert [p.returncode for p in obeys] == [-signal.SIGTERM] * 2
    assert [p.returncode for p in stubborn] == [-signal.SIGKILL] * 2
    assert took < 1.0 * 2, "the grace is shared, not one per process"


def test_give_up_ends_the_wait_early(procs):
    p = procs.popen([sys.executable, "-c", _IGNORES], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    killed = stop_in_stages([p], ask=lambda q: q.send_signal(signal.SIGTERM),
                            running=lambda q: q.poll() is None,
                            kill=lambda q: (q.kill(), q.wait(10)), grace=60.0,
                            give_up=lambda: True)
    assert killed == [p] and p.returncode == -signal.SIGKILL
