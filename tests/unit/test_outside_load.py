"""resihp_core/testing/outside_load.py: the test's own CPU is told from other processes'."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from resihp_core.testing.outside_load import OutsideLoad, own_cpu_seconds

SPIN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\n"


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_childs_cpu_is_the_tests_own_also_once_it_ended():
    before = own_cpu_seconds()
    subprocess.run([sys.executable, "-c", SPIN.format(s=0.4)], check=True)
    # The child ended and was reaped: its time is in this process's cutime/cstime.
    assert own_cpu_seconds() - before >= 0.35


def test_a_process_outside_the_tree_is_counted_outside_and_not_as_own():
    r, w = os.pipe()
    # Double fork: the spinner's parent exits at once, so it is re-parented away from
    # this process's tree (a process of another job, as far as the tree is concerned).
    code = ("import os, sys, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    os.write(%d, (str(os.getpid()) + '\\n').encode())\n"
            "    end = time.time() + 30\n"
            "    while time.time() < end: pass\n"
            "    os._exit(0)\n"
            "os._exit(0)\n") % w
    subprocess.run([sys.executable, "-c", code], check=True, pass_fds=(w,))
    os.close(w)
    with os.fdopen(r) as f:
        pid = int(f.readline())
    try:
        load = OutsideLoad(cores=sorted(os.sched_getaffinity(pid)))
        load.sample()
        own0, cpu0 = own_cpu_seconds(), _cpu_of(pid)
        time.sleep(0.6)
        load.sample()
        own1, cpu1 = own_cpu_seconds(), _cpu_of(pid)
    finally:
        os.kill(pid, signal.SIGKILL)
    spun = cpu1 - cpu0
    assert spun >= 0.1, spun  # it ran (however loaded the machine)
    assert own1 - own0 < spun / 2, (own1 - own0, spun)  # not ours ...
    assert load.cpu_seconds() >= 0.8 * spun - 0.05, (load.cpu_seconds(), spun)  # ... but outside
    assert load.cores_used() > 0


def test_no_samples_is_not_quiet():
    load = OutsideLoad()
    assert not load.quiet()
    load.sample()
    assert load.cores_used() == 0.0 and not load.quiet()


def test_cores_used_and_peak_read_busy_time_minus_own_over_wall_time():
    from resihp_core.testing.outside_load import _Sample

    load = OutsideLoad(cores=[0, 1])
    # 4 s: the cores were busy 6 CPU s, 4 of them the test's own; the outside 2 s all in
    # the last 2 s (a burst).
    load.samples = [_Sample(0.0, 100.0, 10.0), _Sample(2.0, 102.0, 12.0), _Sample(4.0, 106.0, 14.0)]
    assert load.cpu_seconds() == 2.0
    assert load.cores_used() == 0.5
    assert load.peak(2.0) == 1.0
    assert load.quiet(0.25) and not load.quiet(0.2)
