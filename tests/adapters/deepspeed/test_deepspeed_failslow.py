"""A fail-slow on a DeepSpeed job, end to end: one rank's compute is slowed from some
iteration on (the FaultInjector stretches every forward and backward it measures), the
Detector of the running job reports that device as fail-slow, the Scheduler posts a
new plan generation that gives it less work (layer repartition or DP work migration,
whichever it picks), and the final parameters and every iteration's loss equal the
fault-free single-process reference with the same micro-batches (float64, <= 1e-9)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _scenario as S  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

# Big enough that compute is most of an iteration (a few ms per micro-batch and stage),
# so a slowed rank moves the iteration time well past the Detector's 25 % threshold.
HIDDEN, MBS = 192, 32
# As the chaos tests: the Detector's series starts at a generation's third iteration and
# needs 5 healthy observations before a change point; SETTLE leaves room for a late
# detection on a loaded machine (or after a re-plan for another device's host
# contention), then iterations under the new plan.
ONSET, SETTLE, FACTOR = 10, 16, 6.0


def _work(plan, device) -> float:
    """Layer x micro-batch units ``device`` computes in ``plan`` (0 if it has none)."""
    where = plan.location(device)
    if where is None:
        return 0.0
    r, s, _ = where
    return plan.layers(s) * len(plan.work(r, s)) / plan.degree(r, s)


@pytest.mark.timeout(300)
def test_a_slowed_rank_is_detected_and_given_less_work_and_training_stays_exact(tmp_path, monkeypatch):
    from resihp_core.config import DetectorConfig
    from resihp_core.faults import fail_at
    from resihp_core.runtime.controller.payback import PaybackRule
    from resihp_core.runtime.controller.resilient import ResilientConfig, run_resilient
    from resihp_core.testing.conformance import _assemble

    from resihp_adapters.deepspeed.launch import assemble_launch

    iterations = ONSET + SETTLE
    # The planning model and job description ``resihp launch`` builds from a DeepSpeed
    # config (PP2 x DP2, one node), with the model given by name, as ``resihp run`` does.
    ds = {"gradient_accumulation_steps": S.MB}
    sec = {"num_layers": S.LAYERS, "iterations": iterations, "pp": 2, "timeout_s": 10, "checkpoint_every": 0}
    job = assemble_launch(4, ds, sec, tmp_path)
    plan, topology, spec, state, planner = job.plan, job.topology, job.spec, job.state, job.planner
    slow = plan.group(1, 1)[0]  # replica 1, stage 1
    spec = dataclasses.replace(
        spec, adapter_config={"model": "_model:build", "lr": S.LR, "num_layers": S.LAYERS, "seed": S.SEED,
                              "hidden": HIDDEN, "micro_batch_size": MBS},
        dump_dir=str(tmp_path / "dump"), checkpoint_dir=None,
        faults=[fail_at(slow, ONSET, "slow", factor=FACTOR).to_dict()])
    os.makedirs(spec.dump_dir)
    # Workers (started by the node agent with this environment) import the model by name.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # Nothing is killed: heartbeats may lapse (a starved worker on a loaded machine is no
    # hung device); warm-up and change-point gap as the chaos tests'.
    det = DetectorConfig(heartbeat_interval_s=0.1, heartbeat_miss_limit=100, hang_min_timeout_s=20.0,
                         warmup_iterations=3, min_changepoint_gap=3)
    run = run_resilient(ResilientConfig(spec=spec, plan=plan, topology=topology, state=state, planner=planner,
                                        detector=det, iterations=iterations, workdir=tmp_path / "job", timeout_s=240,
                                        # a job this short cannot amortise a re-plan: take one as free (the
                                        # re-plan itself is under test, as in test_chaos)
                                        payback=PaybackRule(default_cost_s=0.0)))
    assert run.ok, f"{run.error}; logs in {run.logs}"
    assert len(run.records) == iterations

    failures = [e for e in run.events if e["kind"] == "failure"]
    # Nothing fails-stop, and the slowed device is reported (localised: not with every device).
    assert not [e for e in failures if e["failure"] != "fail-slow"], run.events
    mine = [e for e in failures if slow in e["devices"]]
    assert mine and all(len(e["devices"]) < len(plan.devices()) for e in mine), run.events
    # A fail-slow report of a healthy worker, alone or named next to the slowed device (4
    # workers on 2 shared cores: CI runs had a 1.35x contention one as the slowdown
    # began, and 1.33x / 1.65x compute ones), is the Detector's call on a loaded machine,
    # not this fault's: a false report, measured by benchmarks/false_reports.py
    # (docs/detector.md "Tests"), printed here.
    others = [e for e in failures if slow not in e["devices"]]
    if others:
        print("fail-slow reports of healthy devices (false reports):", others)
    assert any(e["kind"] == "plan" and e["generation"] >= 1 for e in run.events), run.events
    assert any(r.generation >= 1 for r in run.records), [(r.iteration, r.generation) for r in run.records]
    final = run.final_plan
    assert final.generation >= 1
    assert _work(final, slow) < _work(plan, slow), f"device {slow} keeps its work:\n{final.to_text()}"

    torch.set_num_threads(1)  # the reference runs here, beside the workers' processes
    ref, ref_losses = S.reference([S.DP] * iterations, hidden=HIDDEN, micro_batch_size=MBS)
    for i, (rec, want) in enumerate(zip(run.records, ref_losses)):
        assert abs(rec.loss - want) <= 1e-9 * abs(want), (i, rec.generation, rec.loss, want)
    dumps = {int(f.name[len("device"):-3]): torch.load(f, weights_only=False)
             for f in Path(spec.dump_dir).glob("device*.pt")}
    assert all(d["iteration"] == iterations for d in dumps.values()), {k: d["iteration"] for k, d in dumps.items()}
    got = _assemble(dumps)
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    for name, want in ref.items():
        err = float((got[name][0] - want).abs().max() / want.abs().max().clamp_min(1e-30))
        assert err <= 1e-9, (name, err)
    print(json.dumps({"final_plan": final.to_text(), "slow": slow,
                      "seconds": [round(r.seconds, 3) for r in run.records]}))
