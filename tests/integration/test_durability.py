"""Durable checkpoints on the whole runtime (controller, agents, workers, supervisor):
a checkpoint folder that turns read-only mid-run is a reported storage fault, not a
stopped job; a corrupt newest checkpoint makes a forced restore fall back to the newest
complete one and the job still ends with the fault-free parameters (float64); a
controller killed with SIGKILL is resumed by ``resihp run --resume`` to the same
parameters as an uninterrupted run."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from resihp_core import checkpoints
from resihp_core.faults import fail_at
from resihp_core.runtime.controller.resilient import ResilientConfig, run_resilient
from resihp_adapters.megatron_ref.adapter import data_spec, model_config
from resihp_adapters.megatron_ref.reference import reference_run
from resihp_adapters.torchkit.checkpoint import load_component

from .backend_harness import Finished, check_against_reference, job_spec, read_dumps, tmpdir, uniform
from .proctree import alive, descendants
from .test_chaos import DETECTOR, _planner_state, hooks_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _run(spec, plan, iterations, repair_requests=None, detector=DETECTOR, **hooks):
    from resihp_core.plan import Topology

    topology = Topology.uniform(2, len(plan.devices()) // 2)
    state, planner = _planner_state(plan, topology)
    return run_resilient(ResilientConfig(spec=spec, plan=plan, topology=topology, state=state, planner=planner,
                                         detector=detector, iterations=iterations, workdir=Path(tmpdir()), timeout_s=200,
                                         repair_requests=repair_requests, hooks=hooks_of(**hooks)))


def _wait_for(pred, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.005)
    return False


@contextlib.contextmanager
def _read_only(folder: str):
    """Make ``folder`` refuse new entries: mode 0555, or for root (whom modes do not
    stop) the immutable attribute."""
    root = os.geteuid() == 0
    if root and shutil.which("chattr") is None:
        pytest.skip("running as root without chattr: cannot make a folder read-only")
    cmd = ["chattr", "+i", folder] if root else None
    state = {"on": False}

    def on() -> None:
        subprocess.run(cmd, check=True) if cmd else os.chmod(folder, 0o555)
        state["on"] = True

    def off() -> None:
        if state["on"]:
            subprocess.run(["chattr", "-i", folder], check=True) if cmd else os.chmod(folder, 0o755)
            state["on"] = False

    try:
        yield on, off
    finally:
        off()


def test_read_only_checkpoint_folder_is_reported_and_the_job_goes_on():
    plan = uniform(1, 2, 2, 2)
    ckpt = tmpdir()
    # Every device computes 4x slower from the start (nothing changes, so no fail-slow):
    # on a fast, quiet machine the job would otherwise end before a write can fail.
    steady = [fail_at(d, 0, "slow", factor=4.0).to_dict() for d in plan.devices()]
    spec = job_spec(dp=2, m=2, dump_dir=tmpdir(), checkpoint_dir=ckpt, checkpoint_every=1, checkpoint_keep=2,
                    faults=steady)
    storage = threading.Event()

    def on_event(ev):
        if ev.kind == "storage":
            storage.set()

    with _read_only(ckpt) as (on, off):
        def chaos(job, agents):
            def go():
                if _wait_for(lambda: checkpoints.verify(ckpt, 1).complete):
                    on()  # no new iteration folder can be made from now on
                    storage.wait(120)
                    off()  # writable again: the next interval's checkpoint succeeds
            threading.Thread(target=go, daemon=True).start()

        iterations = 10
        run = _run(spec, plan, iterations, before_run=chaos, on_event=on_event)
    assert run.ok, f"{run.error}; logs in {run.logs}"
    assert len(run.records) == iterations
    faults = [e for e in run.events if e["kind"] == "storage"]
    assert faults and "training goes on" in faults[0]["text"], run.events
    # The storage fault is no failure: nothing reconfigures the job but, on a loaded host,
    # a fail-slow report of a starved device (the Detector's business, not storage's).
    assert all(e.get("failure") == "fail-slow" for e in run.events if e["kind"] == "failure"), run.events
    assert not any(e["kind"] == "plan" and e.get("restore") is not None for e in run.events)
    check_against_reference(Finished(spec, read_dumps(spec), [r.loss for r in run.records], []), iterations)
    # the last checkpoint was written once the folder was writable again; retention kept 2
    assert checkpoints.newest_complete(ckpt)[0] == iterations - 1
    assert len([c for c in checkpoints.scan(ckpt) if c.complete]) == 2


def test_corrupt_newest_checkpoint_restore_falls_back_and_the_job_is_exact():
    plan = uniform(1, 2, 2, 2)
    ckpt = tmpdir()
    # Every device computes 4x slower from the start (no fail-slow: nothing changes), so
    # the job is still running when the relaunched worker is up on a fast, quiet machine.
    steady = [fail_at(d, 0, "slow", factor=4.0).to_dict() for d in plan.devices()]
    spec = job_spec(dp=2, m=2, dump_dir=tmpdir(), checkpoint_dir=ckpt, checkpoint_every=3, checkpoint_keep=3,
                    faults=[fail_at(plan.group(1, 1)[0], 1, "kill").to_dict(), *steady])
    repaired: queue.Queue = queue.Queue()
    victim = plan.group(1, 1)[0]
    rejoined = threading.Event()

    def on_event(ev):
        if ev.kind == "plan" and "rejoin" in ev.text:
            rejoined.set()

    with _read_only(ckpt) as (freeze, _):
        def chaos(job, agents):
            def go():
                # Checkpoints at iterations 2, 5, 8, ...: once 5 is complete, no new
                # checkpoint folder can be made (a write in flight may still complete),
                # the killed device is repaired (bringing it back forces every worker to
                # restore), and 5 and whatever completes after it are corrupted. Nothing
                # newer can appear while the relaunched worker starts, so no corruption
                # races the restore's own verification, however long the start takes.
                if not _wait_for(lambda: checkpoints.verify(ckpt, 5).complete):
                    return
                freeze()
                repaired.put([victim])
                done: set[int] = set()
                while not rejoined.is_set():
                    for info in checkpoints.scan(ckpt):
                        if info.complete and info.iteration >= 5 and info.iteration not in done:
                            f = checkpoints.iteration_dir(ckpt, info.iteration) / "layers.3.pt"
                            data = bytearray(f.read_bytes())
                            data[len(data) // 2] ^= 0xFF
                            f.write_bytes(bytes(data))
                            done.add(info.iteration)
                    time.sleep(0.002)
            threading.Thread(target=go, daemon=True).start()

        iterations = 40  # the relaunched worker must be up (seconds of imports) before the job ends
        # The relaunched worker's imports compete with the job for the two cores: a real
        # contention the Detector may report and re-plan around, after which no rejoin
        # restore need follow within the 40 iterations. This test is about the restore;
        # a slowdown threshold of 100x keeps fail-slow out of it.
        run = _run(spec, plan, iterations, before_run=chaos, repair_requests=repaired, on_event=on_event,
                   detector=dataclasses.replace(DETECTOR, slow_threshold=100.0))
    assert run.ok, f"{run.error}; logs in {run.logs}"
    assert len(run.records) == iterations
    notes = [e for e in run.events if e["kind"] == "checkpoint"]
    assert notes, run.events
    assert "iteration 5 is not usable" in notes[0]["text"] and "corrupt" in notes[0]["text"]
    assert notes[0]["restore"] == 2 and "falling back to the checkpoint of iteration 2" in notes[0]["text"]
    rejoin = [e for e in run.events if e["kind"] == "plan" and "rejoin" in e["text"]]
    assert rejoin and rejoin[0]["resume"] == 3  # iterations 3.. re-trained from the checkpoint of 2
    dumps = read_dumps(spec)
    assert victim in dumps  # the repaired device trained again
    check_against_reference(Finished(spec, dumps, [r.loss for r in run.records], []), iterations)


# ------------------------------------------------------------------ controller crash
CLI = [sys.executable, "-m", "resihp_core.cli"]
CONFIG = """
[parallel]
tp = 1
pp = 2
dp = 2
[model]
layers = 4
hidden = 32
heads = 4
vocab = 64
ffn_hidden = 64
[training]
microbatches = 2
token_budget = 64
iterations = {iterations}
dtype = "float64"
checkpoint_every = 2
checkpoint_keep = 2
[runtime]
nodes = 2
devices_per_node = 2
controller_grace_s = 0  # the processes end with their controller (failover: test_failover.py)
[detector]
heartbeat_interval_s = 0.1
heartbeat_miss_limit = 8
hang_min_timeout_s = 20.0
warmup_iterations = 3
"""



def test_controller_sigkill_then_resume_gives_the_uninterrupted_parameters(tmp_path):
    iterations = 10
    cfg = tmp_path / "job.toml"
    cfg.write_text(CONFIG.format(iterations=iterations))
    work = tmp_path / "work"
    ckpt = work / "checkpoints"
    args = [*CLI, "run", str(cfg), "--no-live", "--report", str(tmp_path / "reports"), "--workdir", str(work)]
    first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    family: set[int] = set()
    try:
        assert _wait_for(lambda: checkpoints.newest_complete(ckpt)[0] is not None
                         and checkpoints.newest_complete(ckpt)[0] >= 3 or first.poll() is not None, 150)
        assert first.poll() is None, first.communicate()[0][-3000:]
        family = descendants(first.pid)
        first.kill()  # the controller dies: SIGKILL, no clean-up of its own
        first.wait(10)
        # its agents and workers notice and exit by themselves
        assert _wait_for(lambda: not any(alive(p) for p in family), 60), \
            f"left behind: {[p for p in family if alive(p)]}"
    finally:
        for p in [first.pid, *family]:
            with contextlib.suppress(ProcessLookupError):
                if alive(p):
                    os.kill(p, signal.SIGKILL)
    point = checkpoints.newest_complete(ckpt)[0]
    assert point is not None and point < iterations - 1
    resumed = subprocess.run([*args, "--resume"], capture_output=True, text=True, timeout=180)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-4000:]
    assert f"resume: from the checkpoint of iteration {point}" in out
    assert "loss vs fault-free reference" in out and ": ok" in out
    # The final checkpoint holds every parameter and AdamW tensor after the last
    # iteration; an uninterrupted run ends with the fault-free reference's (float64).
    assert checkpoints.newest_complete(ckpt)[0] == iterations - 1
    from resihp_core.config import load_config
    from resihp_core.runtime.controller.jobs import build_job

    spec = build_job(load_config(cfg), [], work).spec
    torch.set_num_threads(1)
    ref, _ = reference_run(model_config(spec), data_spec(spec), iterations, lr=float(spec.adapter_config["lr"]))
    names = set()
    for comp in ["embed", *(f"layers.{i}" for i in range(4)), "head"]:
        for name, tensors in load_component(ckpt, iterations - 1, comp).items():
            names.add(name)
            for got, exp in zip(tensors, ref[name]):
                err = ((got - exp).abs().max() / exp.abs().max().clamp_min(1e-30)).item()
                assert err <= 1e-9, f"{name}: relative error {err:.3g}"
    assert names == set(ref)
