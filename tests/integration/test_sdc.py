"""Silent data corruption caught before the corrupt update commits (docs/sdc.md), on the
production path (``run_resilient``: controller, agent, supervisor, the Scheduler's own
planner) with the reference backend in float64: a bit flipped in one replica's reduced
gradient aborts that iteration on every device; with three replicas the odd one is
quarantined and training goes on without it; with two a transient flip is re-executed
and nothing is quarantined, while a repeating one stops the job naming both (no majority
to decide). Where it trains on, the final complete state equals the fault-free run's.
torch_native with HSDP replicate groups: the same quarantine, exact against one process
training the fault-free global batch. Where nothing is replicated (DP = 1, two pipeline
stages), the range check: a transient exponent-bit flip is re-executed and commits, a
repeating one quarantines its device after one aborted iteration, and the state equals
the fault-free run's."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from resihp_core.faults import fail_at
from resihp_core.job import JobSpec
from resihp_core.plan import ParallelPlan

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ITERATIONS, FLIP_AT = 5, 2


def _job(dp: int, m: int) -> JobSpec:
    return JobSpec(adapter="megatron_ref",
                   adapter_config=dict(vocab_size=64, hidden=32, num_heads=4, ffn_hidden=64, num_layers=2,
                                       dtype="float64"),
                   data=dict(source="synthetic", scale=12.0, shape=0.8, min_len=2, max_len=64, token_budget=64),
                   dp=dp, num_microbatches=m)


def _base(dp: int, m: int) -> ParallelPlan:
    return ParallelPlan.uniform(tp=1, pp=1, dp=dp, num_layers=2, num_microbatches=m, num_heads=4)


def _flipped(job: JobSpec, base: ParallelPlan, fault, iterations: int = ITERATIONS):
    """Run ``job`` with ``fault`` through ``run_resilient`` (the assembled job's own
    planner); its outcome (as the conformance kit reads one), events and final plan."""
    import torch

    from resihp_core.runtime.controller.resilient import run_resilient
    from resihp_core.runtime.controller.runconfig import RunHooks
    from resihp_core.testing.conformance import Outcome, _assemble, _assemble_full, _kit_job

    dump, work = tempfile.mkdtemp(prefix="resihp-sdc-"), tempfile.mkdtemp(prefix="resihp-sdc-job-")
    asm = _kit_job(dataclasses.replace(job, dump_dir=dump), base, iterations=iterations,
                   faults=fault if isinstance(fault, list) else [fault],
                   timeout=60.0, work=work)
    jobs = []
    run = dataclasses.replace(asm.run, timeout_s=300.0, hooks=RunHooks(before_run=lambda lj, agents: jobs.append(lj)))
    out = run_resilient(run)
    assert out.ok, f"{out.error} (logs: {out.logs})"
    lj = jobs[0]
    losses, computed = [], []
    for i in range(iterations):
        rep = lj.report(i)
        losses.append(sum(r.loss for r in rep.values()))
        computed.append(Counter(tuple(c) for r in rep.values() for c in r.computed))
    dumps = {int(f[len("device"):-3]): torch.load(os.path.join(dump, f), weights_only=False) for f in os.listdir(dump)}
    assert all(d["iteration"] == iterations for d in dumps.values())
    logs = "".join(p.read_text(errors="replace") for p in Path(work).rglob("*.log"))
    return Outcome(_assemble(dumps), losses, computed, _assemble_full(dumps)), out, logs


def test_a_bad_device_among_three_replicas_is_quarantined_after_one_aborted_iteration():
    from resihp_core.testing.conformance import _compare, run_scenario

    victim = 1
    job, base = _job(3, 2), _base(3, 2)
    got, out, logs = _flipped(job, base, fail_at(victim, FLIP_AT, "flip", target="grad", bit=20, repeat=True))
    sdc = [e for e in out.events if e["kind"] == "sdc"]
    assert len(sdc) == 1 and sdc[0]["suspects"] == [victim] and sdc[0]["iteration"] == FLIP_AT, sdc
    failures = [e for e in out.events if e["kind"] == "failure"]
    assert [(f["cause"], f["devices"]) for f in failures] == [("sdc", [victim])], failures
    assert victim not in out.final_plan.devices()
    assert logs.count("event=bit_flipped") == 1  # the corrupting device never ran again
    assert logs.count("event=sdc_detected") == 1
    committed_in = {r.iteration: r.generation for r in out.records}
    assert committed_in[FLIP_AT] > committed_in[FLIP_AT - 1]  # iteration k committed only after the abort
    want = run_scenario(job, base, None, iterations=ITERATIONS)
    assert _compare("sdc", got, want, base, job, 1e-9) <= 1e-9


@pytest.mark.skipif(os.environ.get("RESIHP_SDC_OPTIMIZER") != "1",
                    reason="about 25 s: opt in with RESIHP_SDC_OPTIMIZER=1")
def test_an_optimizer_state_flip_outside_the_window_is_found_through_the_next_update():
    """A flip of one replica's first AdamW moment after iteration k's step, in a part of
    the state k's window does not read: k commits, iteration k + 1's update of that
    parameter differs, k + 1 aborts, the replica is quarantined, and the survivors'
    state equals the fault-free run's (the corrupt moment never left its replica)."""
    from resihp_core.testing.conformance import _compare, run_scenario

    victim, n = 1, ITERATIONS + 1
    job, base = _job(3, 2), _base(3, 2)
    got, out, logs = _flipped(job, base, fail_at(victim, FLIP_AT, "flip", target="optimizer", bit=20), n)
    sdc = [e for e in out.events if e["kind"] == "sdc"]
    # every state tensor here is one window, read once in 8 steps: not in step FLIP_AT + 1's
    assert len(sdc) == 1 and sdc[0]["suspects"] == [victim] and sdc[0]["iteration"] == FLIP_AT + 1, sdc
    assert [(f["cause"], f["devices"]) for f in out.events if f["kind"] == "failure"] == [("sdc", [victim])]
    committed_in = {r.iteration: r.generation for r in out.records}
    assert committed_in[FLIP_AT] == committed_in[FLIP_AT - 1] < committed_in[FLIP_AT + 1]
    want = run_scenario(job, base, None, iterations=n)
    assert _compare("sdc", got, want, base, job, 1e-9) <= 1e-9


def test_a_transient_flip_between_two_replicas_is_re_executed_and_quarantines_nothing():
    from resihp_core.testing.conformance import _compare, run_scenario

    victim = 0
    job, base = _job(2, 2), _base(2, 2)
    got, out, logs = _flipped(job, base, fail_at(victim, FLIP_AT, "flip", target="grad", bit=20))
    sdc = [e for e in out.events if e["kind"] == "sdc"]
    assert len(sdc) == 2 and "re-executing" in sdc[0]["text"] and "transient" in sdc[1]["text"], sdc
    assert sdc[0]["candidates"] == [0, 1]
    assert not [e for e in out.events if e["kind"] == "failure"]
    assert [e.get("kind_of_plan") for e in out.events if e["kind"] == "plan"][1:] == ["retry"]
    assert out.final_plan.devices() == base.devices()
    assert logs.count("event=bit_flipped") == 1
    committed_in = {r.iteration: r.generation for r in out.records}
    assert committed_in[FLIP_AT] > committed_in[FLIP_AT - 1]
    want = run_scenario(job, base, None, iterations=ITERATIONS)
    assert _compare("sdc", got, want, base, job, 1e-9) <= 1e-9


def test_a_bad_device_between_two_replicas_stops_the_job_naming_both():
    """Two replicas that disagree again on re-execution: no majority says which one is
    wrong, and the job stops with a message naming both rather than guess."""
    from resihp_core.runtime.controller.resilient import run_resilient
    from resihp_core.testing.conformance import _kit_job

    job, base = _job(2, 2), _base(2, 2)
    asm = _kit_job(dataclasses.replace(job, dump_dir=tempfile.mkdtemp(prefix="resihp-sdc-")), base,
                   iterations=ITERATIONS, faults=[fail_at(0, FLIP_AT, "flip", repeat=True)], timeout=60.0,
                   work=tempfile.mkdtemp(prefix="resihp-sdc-job-"))
    out = run_resilient(dataclasses.replace(asm.run, timeout_s=300.0))
    assert not out.ok and "persisted on re-execution among devices [0, 1]" in out.error, out.error
    assert "refuses to guess" in out.error
    assert [e.get("kind_of_plan") for e in out.events if e["kind"] == "plan"][1:] == ["retry"]
    assert not [e for e in out.events if e["kind"] == "failure"]  # nothing quarantined on a guess


def test_without_replicas_a_transient_flip_commits_on_re_execution_and_a_bad_device_is_quarantined():
    """DP = 1 over two pipeline stages: no fingerprint group, so the range check
    decides. Device 0 flips an exponent bit of its reduced gradient once at iteration 4
    (after 4 committed iterations of history): out of range, re-executed, the
    re-execution is in range and commits, nothing quarantined. Device 1 flips one every
    iteration from 6: out of range on re-execution too, quarantined. It held stage 1's
    only copy, so the job restores the checkpoint written after iteration 3 on device 0 alone, and
    the final state equals the fault-free run's."""
    from resihp_core.testing.conformance import _compare, run_scenario

    iterations, transient, bad = 8, 4, 6
    job = dataclasses.replace(_job(1, 2), checkpoint_every=4, checkpoint_dir=tempfile.mkdtemp(prefix="resihp-sdc-ck-"))
    base = ParallelPlan.uniform(tp=1, pp=2, dp=1, num_layers=2, num_microbatches=2, num_heads=4)
    got, out, logs = _flipped(job, base, [fail_at(0, transient, "flip", target="grad", bit=62),
                                          fail_at(1, bad, "flip", target="grad", bit=62, repeat=True)], iterations)
    sdc = [e for e in out.events if e["kind"] == "sdc"]
    assert [(e["iteration"], e.get("source")) for e in sdc] == [(transient, "range"), (transient, ""),
                                                               (bad, "range"), (bad, "range")], sdc
    assert "re-executing" in sdc[0]["text"] and sdc[0]["candidates"] == [0] and "transient" in sdc[1]["text"]
    assert "re-executing" in sdc[2]["text"] and sdc[3]["suspects"] == [1], sdc
    failures = [(f["cause"], tuple(f["devices"])) for f in out.events if f["kind"] == "failure"]
    assert failures[0] == ("sdc", (1,)) and set(failures[1:]) <= {("state", (0,))}, failures
    plans = [(e["kind_of_plan"], e["resume"], e["restore"]) for e in out.events if e["kind"] == "plan"][1:]
    assert plans[:2] == [("retry", transient, None), ("retry", bad, None)], plans
    assert plans[-1] == ("restore", transient, transient - 1), plans  # the checkpoint after iteration 3
    assert tuple(out.final_plan.devices()) == (0,)
    assert logs.count("event=bit_flipped") == 3  # 4 once; 6 and its re-execution; never again
    want = run_scenario(job, base, None, iterations=iterations)
    assert _compare("sdc", got, want, base, job, 1e-9) <= 1e-9


def test_torch_native_hsdp_quarantines_a_bad_replica_and_trains_exactly(tmp_path):
    """torch_native with HSDP (``shard = 1``: every replica a replicate group holding the
    whole stage) on three replicas, through ``resihp run``'s assembly: a device that
    flips a bit of its reduced gradient every iteration from 2 is found at the next
    iteration's vote and quarantined after that one aborted iteration, its micro-batches
    run on the two survivors, and the final state and every loss equal one process
    training the fault-free global batch."""
    from resihp_core.testing.conformance import _assemble

    from .test_torch_native import MODEL, TOL, as_triples, max_rel_err, reference
    from .test_torch_native_dp import CONFIG, M, run_job

    victim = 1
    config = (CONFIG.replace("dp = 4", "dp = 3").replace("devices_per_node = 4", "devices_per_node = 3")
              + "[adapter]\nshard = 1\n")
    run, dumps = run_job(tmp_path, ITERATIONS, [{"device": victim, "iteration": FLIP_AT, "kind": "flip",
                                                 "repeat": True}], checkpoint_every=0, config=config)
    sdc = [e for e in run.events if e["kind"] == "sdc"]
    # Three replicas step after the commit (docs/sdc.md): the corrupt step of FLIP_AT is
    # the victim's alone, and its parameters differ at the vote of the next iteration.
    assert len(sdc) == 1 and sdc[0]["suspects"] == [victim] and sdc[0]["iteration"] == FLIP_AT + 1, sdc
    failures = [e for e in run.events if e["kind"] == "failure"]
    assert [(f["cause"], f["devices"]) for f in failures] == [("sdc", [victim])], failures
    assert victim not in run.final_plan.devices() and victim not in dumps
    ref, losses = reference(ITERATIONS, dp=3, m=M, model=MODEL)
    assert max_rel_err(as_triples(_assemble(dumps)), ref) <= TOL
    for i, (rec, want) in enumerate(zip(run.records, losses)):
        assert abs(rec.loss - want) <= TOL * abs(want), (i, rec.generation, rec.loss, want)


@pytest.mark.skipif(os.environ.get("RESIHP_TORCH_NATIVE_SDC_RANGE") != "1",
                    reason="about a minute: opt in with RESIHP_TORCH_NATIVE_SDC_RANGE=1")
def test_torch_native_plain_fsdp2_quarantines_a_device_out_of_range_and_trains_exactly(tmp_path):
    """torch_native with plain FSDP2 on three replicas (``shard = 0``: no two devices
    hold the same shard, so no fingerprints): a device flipping an exponent bit of its
    reduced gradient every iteration from 5 is out of range, out of range again on
    re-execution, and quarantined; its shard is restored from the checkpoint, and the
    final state and every loss equal one process training the fault-free global batch."""
    from resihp_core.testing.conformance import _assemble

    from .test_torch_native import MODEL, TOL, as_triples, max_rel_err, reference
    from .test_torch_native_dp import CONFIG, M, run_job

    victim, at, iterations = 1, 5, 7
    config = CONFIG.replace("dp = 4", "dp = 3").replace("devices_per_node = 4", "devices_per_node = 3")
    run, dumps = run_job(tmp_path, iterations, [{"device": victim, "iteration": at, "kind": "flip", "bit": 62,
                                                 "repeat": True}], checkpoint_every=1, config=config)
    sdc = [e for e in run.events if e["kind"] == "sdc"]
    assert [(e["iteration"], e["source"]) for e in sdc] == [(at, "range"), (at, "range")], sdc
    assert sdc[0]["candidates"] == [victim] and sdc[1]["suspects"] == [victim], sdc
    failures = [e for e in run.events if e["kind"] == "failure"]
    assert failures[0]["cause"] == "sdc" and failures[0]["devices"] == [victim], failures
    assert victim not in run.final_plan.devices() and victim not in dumps
    ref, losses = reference(iterations, dp=3, m=M, model=MODEL)
    assert max_rel_err(as_triples(_assemble(dumps)), ref) <= TOL
    for i, (rec, want) in enumerate(zip(run.records, losses)):
        assert abs(rec.loss - want) <= TOL * abs(want), (i, rec.generation, rec.loss, want)
