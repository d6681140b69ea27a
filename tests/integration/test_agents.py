"""Node agents as the launchers of their workers, on one machine and across "hosts".

Each scenario runs the whole runtime with real agent processes that start the workers
themselves. Losing an agent loses its node: its workers die with it (they are started
with a parent-death signal), the controller reports every device of the node, and the
job goes on with the survivors. Parameters must equal the fault-free run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from resihp_core.plan import Topology
from resihp_core.runtime.controller.resilient import ResilientConfig, RunHooks, run_resilient

from .backend_harness import Finished, check_against_reference, job_spec, read_dumps, tmpdir, uniform
from .test_chaos import DETECTOR, _planner_state

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
CLI = [sys.executable, "-m", "resihp_core.cli"]


def _kill_agent_when(job, agent: subprocess.Popen, iteration: int, seen: dict) -> None:
    """SIGKILL ``agent`` once ``iteration`` iterations are committed; remember its workers."""
    def watch() -> None:
        deadline = time.monotonic() + 120
        while job.committed < iteration and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["workers"] = [c.pid for c in psutil.Process(agent.pid).children()]
        agent.kill()

    threading.Thread(target=watch, daemon=True).start()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_killed_agent_takes_its_node_and_the_job_goes_on():
    plan = uniform(2, 2, 2, 3)
    topology = Topology.uniform(2, 4)  # node 1 holds replica 1 (devices 4-7)
    iterations = 6
    spec = job_spec(dp=plan.dp, m=plan.num_microbatches, dump_dir=tmpdir(), checkpoint_dir=tmpdir(),
                    checkpoint_every=1)
    state, planner = _planner_state(plan, topology)
    seen: dict = {}

    def before_run(job, agents):
        seen["agent"] = agents[1]
        _kill_agent_when(job, agents[1], 2, seen)

    run = run_resilient(ResilientConfig(spec=spec, plan=plan, topology=topology, state=state, planner=planner,
                                        detector=DETECTOR, iterations=iterations, workdir=Path(tmpdir()), timeout_s=240,
                                        hooks=RunHooks(before_run=before_run)))
    assert run.ok, f"{run.error}; logs in {run.logs}"
    assert seen["agent"].returncode == -signal.SIGKILL
    assert len(seen["workers"]) == 4 and all(_gone(pid) for pid in seen["workers"])  # died with their agent
    lost = [e for e in run.events if e["kind"] == "failure" and e["failure"] == "fail-stop"]
    assert lost and set(lost[0]["devices"]) == set(topology.nodes()[1])
    assert set(run.final_plan.devices()) == set(topology.nodes()[0])
    dumps = read_dumps(spec)
    assert set(dumps) == set(topology.nodes()[0])
    check_against_reference(Finished(spec, dumps, [r.loss for r in run.records], []), iterations)


def test_resihp_run_with_an_agent_per_host_on_loopback(tmp_path: Path):
    """The multi-host recipe of the README, with two "hosts" on loopback: ``resihp run
    --agents external`` waits; ``resihp agent`` on each host joins; one host's agent is
    lost mid-run and the job finishes on the other with the fault-free losses."""
    root = Path(__file__).resolve().parents[2]
    cfg = root / "examples" / "configs" / "tp1_pp2_dp2.toml"
    env = {**os.environ, "RESIHP_SECRET": "loopback-test-secret", "RESIHP_TRAINING__ITERATIONS": "8",
           "RESIHP_TRAINING__DTYPE": "float64"}
    procs: list[subprocess.Popen] = []
    try:
        head = subprocess.Popen([*CLI, "run", str(cfg), "--agents", "external", "--listen", "127.0.0.1:0",
                                 "--no-live", "--report", str(tmp_path / "reports"), "--agent-timeout", "60"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        procs.append(head)
        out: list[str] = []
        port = None
        while port is None:
            line = head.stdout.readline()
            assert line, "resihp run exited before listening:\n" + "".join(out)
            out.append(line)
            m = re.search(r"controller listening on [\d.]+:(\d+)", line)
            port = m and m.group(1)
        hosts = {}
        for node in (0, 1):
            work = tmp_path / f"host{node}"
            work.mkdir()
            hosts[node] = subprocess.Popen([*CLI, "agent", "--controller", f"127.0.0.1:{port}", "--node", str(node),
                                            "--workdir", str(work)], env=env, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.STDOUT)
            procs.append(hosts[node])
        killed = False
        for line in head.stdout:
            out.append(line)
            if not killed and re.match(r"iteration\s+3\b", line):
                hosts[1].kill()
                killed = True
        assert head.wait(60) == 0, "".join(out)
        text = "".join(out)
        assert killed
        assert "fail-stop of devices [2, 3]" in text
        m = re.search(r"max relative difference ([0-9.e+-]+)", text)
        assert m and float(m.group(1)) <= 1e-9, text
        # each host's agent launched its own workers, in its own folder
        assert sorted(p.name for p in (tmp_path / "host0").glob("worker*.log")) == ["worker0.log", "worker1.log"]
        assert sorted(p.name for p in (tmp_path / "host1").glob("worker*.log")) == ["worker2.log", "worker3.log"]
        assert hosts[0].wait(30) == 0  # the controller ended the job: a plain exit
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def test_a_repaired_device_is_brought_back_with_the_right_state():
    from resihp_core.faults import fail_at, repairs, worker_faults

    plan = uniform(1, 2, 2, 3)
    topology = Topology.uniform(2, 2)
    victim = plan.group(1, 1)[0]
    faults = [fail_at(victim, 2, "kill"), fail_at(victim, 4, "repair")]
    # The relaunched worker is planned in once it has started (seconds of imports): leave
    # the job enough iterations after the repair for that to happen on a busy machine.
    iterations = 40
    spec = job_spec(dp=plan.dp, m=plan.num_microbatches, dump_dir=tmpdir(), checkpoint_dir=tmpdir(),
                    checkpoint_every=1, faults=worker_faults(faults))
    state, planner = _planner_state(plan, topology)
    run = run_resilient(ResilientConfig(spec=spec, plan=plan, topology=topology, state=state, planner=planner,
                                        detector=DETECTOR, iterations=iterations, workdir=Path(tmpdir()), timeout_s=240,
                                        repairs=repairs(faults)))
    assert run.ok, f"{run.error}; logs in {run.logs}"
    rejoins = [e for e in run.events if e.get("kind_of_plan") == "rejoin"]
    assert len(rejoins) == 1 and rejoins[0]["devices"] == [victim] and rejoins[0]["resume"] >= 4
    assert victim in run.final_plan.devices()  # working again, not a standby
    assert (Path(run.logs) / f"worker{victim}.log").read_text().count("event=generation_entered") >= 2
    dumps = read_dumps(spec)
    assert set(dumps) == set(plan.devices())
    check_against_reference(Finished(spec, dumps, [r.loss for r in run.records], []), iterations)
