"""The launch recipes in examples/: the Slurm batch script runs for real against a stub
``srun`` (one agent per "node" on this machine, node ids from ``SLURM_NODEID``), and
the Kubernetes manifests hold together (node id from the completion index, the
controller behind a headless service)."""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "resihp.sbatch"

# srun as Slurm runs one task per node: here every "node" is a process of this machine.
STUB_SRUN = r"""#!/usr/bin/env python3
import os, subprocess, sys
args = sys.argv[1:]
nodes = 1
while args and args[0].startswith("-"):
    a = args.pop(0)
    if a.startswith("--nodes="):
        nodes = int(a.split("=", 1)[1])
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(f"srun nodes={nodes} argv={args!r}\n")
procs = [subprocess.Popen(args, env={**os.environ, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n),
                                     "SLURM_STEP_ID": "0"}) for n in range(nodes)]
sys.exit(max(p.wait() for p in procs))
"""
STUB_HOSTNAME = """#!/bin/sh
[ "$1" = "-I" ] && { echo "127.0.0.1 "; exit 0; }
exec /bin/hostname "$@"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stub(folder: Path, name: str, text: str) -> None:
    p = folder / name
    p.write_text(text)
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_the_slurm_script_runs_a_job_with_one_agent_per_node(tmp_path: Path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    _stub(bin_, "srun", STUB_SRUN)
    _stub(bin_, "hostname", STUB_HOSTNAME)
    resihp = Path(sys.executable).with_name("resihp")
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "STUB_LOG": str(tmp_path / "srun.log"),
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n[0-1]",
           "RESIHP": str(resihp), "RESIHP_PORT": str(_free_port()), "RESIHP_WORKDIR": str(tmp_path),
           "RESIHP_REPORT": str(tmp_path / "reports"),
           "RESIHP_TRAINING__ITERATIONS": "4", "RESIHP_TRAINING__DTYPE": "float64"}
    env.pop("RESIHP_SECRET", None)
    # its own session: whatever the script started is killed with it if it hangs
    proc = subprocess.Popen(["bash", str(SBATCH), str(ROOT / "examples" / "configs" / "tp1_pp2_dp2.toml")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, text
    assert f"controller on {socket.gethostname()} at 127.0.0.1:{env['RESIHP_PORT']}" in text
    m = re.search(r"max relative difference ([0-9.e+-]+)", text)
    assert m and float(m.group(1)) <= 1e-9, text
    assert text.count("the job finished; exiting") == 2, text  # both agents ended plainly
    assert "controller exited 0" in text
    assert "srun nodes=2" in (tmp_path / "srun.log").read_text()
    for node, devices in ((0, ["worker0.log", "worker1.log"]), (1, ["worker2.log", "worker3.log"])):
        work = tmp_path / f"resihp-4242-node{node}"
        assert sorted(p.name for p in work.glob("worker*.log")) == devices  # node id from SLURM_NODEID


def test_the_slurm_script_refuses_to_run_outside_an_allocation(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(["bash", str(SBATCH), "job.toml"], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "not inside a Slurm allocation" in out.stderr


def test_the_kubernetes_recipe_gives_each_pod_its_node_id_and_the_controller_a_stable_name():
    yaml = pytest.importorskip("yaml")
    docs = [d for d in yaml.safe_load_all((ROOT / "examples" / "kubernetes" / "resihp.yaml").read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    svc, job = kinds["Service"], kinds["Job"]
    assert svc["spec"]["clusterIP"] == "None"  # headless: pod DNS names
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    script = " ".join(pod["containers"][0]["command"] + pod["containers"][0].get("args", []))
    assert "JOB_COMPLETION_INDEX" in script and "--node" in script and "resihp agent" in script
    assert "resihp run" in script  # index 0 also runs the controller
