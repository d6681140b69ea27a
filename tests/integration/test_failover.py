"""Controller failover on real processes (docs/failover.md): the controller of a
``resihp run`` job is SIGKILLed mid-run; its agents and workers train on to the end of
their iteration and hold it; ``resihp run --resume`` started seconds later re-attaches
to the same worker processes and the job ends with the fault-free parameters (float64),
with no iteration restored from a checkpoint. A second controller while one runs is
refused; with no controller back within the grace period every process of the job
ends by itself."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from .proctree import alive, descendants

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

# agent_silence_s: 8 workers importing torch on 2 loaded cores starved an agent for the
# derived 3 s; the controller took its node for lost (every device) before the first
# iteration and the job went on in another generation. The controller's death is seen
# by the agents at once (the connection closes), not by silence.

CLI = [sys.executable, "-m", "resihp_core.cli"]
CONFIG = """
[parallel]
tp = {tp}
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
checkpoint_every = 4
checkpoint_keep = 2
[runtime]
nodes = 2
devices_per_node = {per_node}
controller_grace_s = {grace}
[detector]
heartbeat_interval_s = 0.1
heartbeat_miss_limit = 8
hang_min_timeout_s = 20.0
warmup_iterations = 3
agent_silence_s = 30.0
"""


class Output:
    """A process's merged output, read on a thread (so waiting on it never blocks)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.text = proc, ""
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._lock:
                self.text += line

    def wait_for(self, pattern: str, timeout: float) -> re.Match | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                m = re.search(pattern, self.text, re.M)
            if m or self.proc.poll() is not None:
                return m
            time.sleep(0.02)
        return None



def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _wait(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def _kill_all(pids) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if alive(p):
                os.kill(p, signal.SIGKILL)


def _start(cfg: Path, work: Path, tmp: Path, *extra: str) -> tuple[subprocess.Popen, Output]:
    """``resihp run cfg``, or ``resihp launch`` when ``cfg`` is an accelerate config."""
    if cfg.suffix == ".yaml":
        cmd = [*CLI, "launch", "--config_file", str(cfg), "--workdir", str(work), *extra, str(cfg.parent / "train.py")]
    else:
        cmd = [*CLI, "run", str(cfg), "--no-live", "--report", str(tmp / "reports"), "--workdir", str(work), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RESIHP_CONFIG", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=cfg.parent)
    return proc, Output(proc)


def _kill_and_reattach(tmp_path: Path, cfg: Path, n: int, iterations: int, *, refuse_second: bool,
                       worker: str = "runtime.worker") -> tuple[Path, str, str]:
    """Run ``cfg``, SIGKILL its controller at iteration 8 (the first >= 8 it prints),
    ``--resume`` 5 s later; check the re-attach (same pids, no restore, no new
    generation). Returns the work folder and both controllers' output."""
    work = tmp_path / "work"
    first, out1 = _start(cfg, work, tmp_path)
    family: set[int] = set()
    resumed = None
    try:
        assert out1.wait_for(r"^working folder", 120), out1.text[-3000:]
        if refuse_second:  # a second controller for the same job while the first one runs
            second = subprocess.run([*CLI, "run", str(cfg), "--no-live", "--report", str(tmp_path / "r2"),
                                     "--workdir", str(work), "--resume"], capture_output=True, text=True, timeout=120)
            assert second.returncode == 1, second.stdout + second.stderr
            assert (f"a controller (pid {first.pid}) is already running the job in {work.resolve()}"
                    in second.stderr), second.stderr
        m = out1.wait_for(r"^iteration\s+(8|9|1\d)\s+loss", 300)
        assert m and first.poll() is None, out1.text[-3000:]
        family = descendants(first.pid)
        workers = {p for p in family if worker in _cmdline(p)}
        assert len(workers) == n, [_cmdline(p) for p in family]
        first.kill()  # the controller dies: SIGKILL, no clean-up of its own
        first.wait(10)
        seen = int(m.group(1))
        assert seen < iterations - 1
        time.sleep(5)
        assert all(alive(p) for p in workers), "workers must outlive their controller within the grace period"
        resumed, out2 = _start(cfg, work, tmp_path, "--resume")
        a = out2.wait_for(r"attach: controller restarted: re-attached to generation (\d+) at iteration (\d+)", 180)
        assert a, out2.text[-4000:]
        assert all(alive(p) for p in workers), "the restarted controller must re-attach to the same workers"
        assert resumed.wait(180) == 0, out2.text[-4000:]
        text = out2.text
        # Every process of the job has ended (the store host with it).
        assert _wait(lambda: not any(alive(p) for p in family), 30), [_cmdline(p) for p in family if alive(p)]
    finally:
        _kill_all([first.pid, *family])
        if resumed is not None and resumed.poll() is None:
            resumed.kill()
    attached_at = int(a.group(2))
    assert seen < attached_at < iterations, text[-3000:]
    assert "resume: re-attaching to the job's live workers" in text
    assert "from the checkpoint" not in text, text[-3000:]
    # No generation was posted for the restart: one (before the kill or after the
    # re-attach) may follow only a fail-slow report (a starved device on a loaded host
    # moves layers; the Detector's business), never a fail-stop or a restore.
    both = out1.text + text
    planned = re.search(r"^\s+iteration\s+\d+\s+plan\s|\] plan: generation [1-9]", both, re.M)
    assert not planned or ("fail-slow" in both and "fail-stop" not in both), both[-3000:]
    # The same processes ran every iteration: one launch per device in all, from generation 0.
    logs = work / "job"
    launches = re.findall(r"event=worker_launched node=\d+ device=(\d+) pid=(\d+)",
                          "".join((logs / f"agent{node}.log").read_text() for node in (0, 1)))
    assert sorted(int(p) for _, p in launches) == sorted(workers), launches
    for d in range(n):
        entered = re.findall(r"event=generation_entered device=\d+ generation=(\d+)",
                             (logs / f"worker{d}.log").read_text())
        assert entered[:1] == ["0"] and (entered == ["0"] or planned), \
            f"device {d} entered generations {entered}: a reconfiguration or restore"
    return work, out1.text, text


def test_controller_restart_reattaches_to_the_live_workers_and_ends_exact(tmp_path):
    # TP2 x PP2 x DP2: 8 workers on 2 nodes of 4 devices.
    iterations = 20
    cfg = tmp_path / "job.toml"
    cfg.write_text(CONFIG.format(tp=2, per_node=4, iterations=iterations, grace=60))
    work, _, text = _kill_and_reattach(tmp_path, cfg, 8, iterations, refuse_second=True)
    assert "loss vs fault-free reference" in text and ": ok" in text, text[-3000:]
    # Final parameters and AdamW state: those of an uninterrupted run (float64).
    from resihp_adapters.megatron_ref.adapter import data_spec, model_config
    from resihp_adapters.megatron_ref.reference import reference_run
    from resihp_adapters.torchkit.checkpoint import load_component
    from resihp_core import checkpoints
    from resihp_core.config import load_config
    from resihp_core.runtime.controller.jobs import build_job

    ckpt = work / "checkpoints"
    assert checkpoints.newest_complete(ckpt)[0] == iterations - 1
    # Retention across the restart: checkpoint_keep = 2 complete checkpoints, nothing older.
    assert [c.iteration for c in checkpoints.scan(ckpt)] == [iterations - 1, iterations - 5], checkpoints.scan(ckpt)
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


TORCH_NATIVE = """
[parallel]
pp = 2
[model]
layers = 4
hidden = 32
heads = 4
vocab = 64
ffn_hidden = 64
[training]
microbatches = 2
token_budget = 32
iterations = 20
lr = 0.003
dtype = "float64"
checkpoint_every = 4
checkpoint_keep = 2
[adapter]
shard = 0
[runtime]
nodes = 2
controller_grace_s = 60
[detector]
heartbeat_interval_s = 0.1
heartbeat_miss_limit = 8
hang_min_timeout_s = 20.0
warmup_iterations = 3
agent_silence_s = 30.0
"""


def test_a_torch_native_resihp_launch_reattaches_too(tmp_path):
    """``resihp launch`` of the torch_native example (FSDP2 stages in torch's pipeline
    runtime, PP2 x DP2, shards not replicated): a restore would need a checkpoint; the
    re-attach of ``resihp launch --resume`` needs none, every committed iteration,
    before and after, equals the fault-free reference, and so does the final state
    (parameters, AdamW moments and steps; float64)."""
    import shutil

    from resihp_adapters.torch_native.launch import settings
    from resihp_core.runtime.controller.assemble import assemble

    example = Path(__file__).resolve().parents[2] / "examples" / "torch_native"
    job = tmp_path / "job"
    job.mkdir()
    for f in ("accelerate.yaml", "train.py"):
        shutil.copy(example / f, job / f)
    (job / "resihp.toml").write_text(TORCH_NATIVE)
    work, before, after = _kill_and_reattach(tmp_path, job / "accelerate.yaml", 4, 20, refuse_second=False,
                                             worker="launch_worker")
    printed = [{int(i): float(x) for i, x in re.findall(r"^iteration\s+(\d+)\s+loss ([0-9.e+-]+)", text, re.M)}
               for text in (before, after)]
    # The first controller prints iterations 0..k, the restarted one from the iteration it
    # re-attached at to the end; an iteration the first one committed in the moment
    # between its last printed line and its SIGKILL is printed by neither (it is in the
    # final state compared below).
    assert sorted(printed[0]) == list(range(len(printed[0]))), sorted(printed[0])
    assert sorted(printed[1]) == list(range(20 - len(printed[1]), 20)), sorted(printed[1])
    losses = {**printed[0], **printed[1]}
    spec = assemble(settings(job / "resihp.toml", processes=4), [], work).spec
    ref, want = _torch_native_reference(spec, 20)  # one run gives the losses and the final state
    for i, got_loss in losses.items():
        w = want[i]
        assert abs(got_loss - w) <= 1e-9 * abs(w) + 1e-10, (i, got_loss, w)  # printed with 10 decimals
    # Final parameters and AdamW state (moments and step count): those of the fault-free
    # run (float64), read from the job's last checkpoint (iteration 19, written by the
    # workers after the re-attach).
    from resihp_core import checkpoints

    assert checkpoints.newest_complete(spec.checkpoint_dir)[0] == 19
    # Retention: checkpoint_keep = 2 complete checkpoints, nothing older.
    assert [c.iteration for c in checkpoints.scan(spec.checkpoint_dir)] == [19, 15], checkpoints.scan(spec.checkpoint_dir)
    got = _torch_native_checkpoint(spec, 19)
    assert set(got) == set(ref)
    for name, (param, m, v) in ref.items():
        assert float(got[name][3]) == 20.0, f"{name}: AdamW step {float(got[name][3])}, not 20"
        for what, a, b in zip(("parameter", "exp_avg", "exp_avg_sq"), got[name][:3], (param, m, v)):
            err = float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))
            assert err <= 1e-9, f"{name} {what}: relative error {err:.3g}"


def _torch_native_reference(spec, iterations: int):
    """The fault-free single-process run of ``spec``: ({name: (param, exp_avg,
    exp_avg_sq)}, losses)."""
    from resihp_adapters.torch_native.adapter import parse_config
    from resihp_adapters.torch_native.data import Batches, job_source
    from resihp_adapters.torch_native.reference import single_process_run

    torch.set_num_threads(1)
    c = parse_config(spec.adapter_config, spec.seed)
    data = Batches(job_source(spec, c["model"].vocab_size), c["model"].torch_dtype)
    return single_process_run(c["model"], data, iterations, lr=c["lr"], weight_decay=c["weight_decay"])


def _torch_native_checkpoint(spec, iteration: int) -> dict:
    """Checkpoint ``iteration`` of a torch_native job read whole in this process (no
    process group) in the engine's own layout: {name: (param, exp_avg, exp_avg_sq, step)}."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

    from resihp_adapters.torch_native.adapter import parse_config
    from resihp_adapters.torch_native.engine import read_checkpoint
    from resihp_adapters.torch_native.model import build_stage
    from resihp_core import checkpoints

    c = parse_config(spec.adapter_config, spec.seed)
    model = build_stage(c["model"], 0, c["model"].n_layers)
    opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], weight_decay=c["weight_decay"], foreach=False)
    for p in model.parameters():  # every key present, as the engine saves them
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    sd = {"model": get_model_state_dict(model, options=opts), "optim": get_optimizer_state_dict(model, opt, options=opts)}
    sd = read_checkpoint(sd, str(checkpoints.iteration_dir(spec.checkpoint_dir, iteration) / "dcp"), alone=True)
    m, o = sd["model"], sd["optim"]
    return {n: (m[n], o[f"state.{n}.exp_avg"], o[f"state.{n}.exp_avg_sq"], o[f"state.{n}.step"])
            for n, _ in model.named_parameters()}


def test_no_controller_within_the_grace_period_ends_every_process(tmp_path):
    grace = 4
    cfg = tmp_path / "job.toml"
    cfg.write_text(CONFIG.format(tp=1, per_node=2, iterations=200, grace=grace))
    work = tmp_path / "work"
    first, out = _start(cfg, work, tmp_path)
    family: set[int] = set()
    try:
        assert out.wait_for(r"^iteration\s+\d+\s+loss", 200), out.text[-3000:]
        family = descendants(first.pid)
        kinds = {k for p in family for k in ("runtime.worker", "runtime.agent", "runtime.controller.storehost")
                 if k in _cmdline(p)}
        assert kinds == {"runtime.worker", "runtime.agent", "runtime.controller.storehost"}, kinds
        first.kill()
        first.wait(10)
        killed = time.monotonic()
        # Within the grace period they wait for a controller ...
        time.sleep(1.0)
        assert all(alive(p) for p in family), [_cmdline(p) for p in family if not alive(p)]
        # ... past it, agents end their workers and themselves, the store host ends.
        assert _wait(lambda: not any(alive(p) for p in family), 60), \
            f"left behind: {[_cmdline(p) for p in family if alive(p)]}"
        assert time.monotonic() - killed >= grace - 0.5
    finally:
        _kill_all([first.pid, *family])
