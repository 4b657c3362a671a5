import subprocess
import sys
import time

from neuronmp.host import procid


def test_identity_of_live_and_dead_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ident = procid.of(proc.pid)
        assert ident is not None and ident.alive()
        deadline = time.monotonic() + 10  # until exec, the child still shows our command line
        while "time.sleep" not in procid.cmdline(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "time.sleep" in procid.cmdline(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not ident.alive() and procid.of(proc.pid) is None


def test_reused_pid_with_other_start_time_is_not_alive():
    me = procid.current()
    assert me.alive()
    assert not procid.ProcId(me.pid, me.start + 1).alive()
