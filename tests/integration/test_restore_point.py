"""Restores resume where the job was, for every adapter (docs/checkpoints.md).

torch_native (FSDP2: a SIGKILLed rank takes its shard with it) and DeepSpeed jobs
killed at iteration 10 with ``checkpoint_every = 4`` run under the whole runtime
(controller, agents, workers, supervisor): the supervisor restores from the
checkpoint of iteration 7 (the newest complete one, written in the core's layout by
the adapter), never re-trains iterations 0-7 (from the events), and the job ends with
the fault-free run's parameters and optimizer state (float64). Retention keeps
``checkpoint_keep`` complete checkpoints for both (megatron_ref's is in
test_durability.py).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from resihp_core import checkpoints  # noqa: E402
from resihp_core.faults import fail_at  # noqa: E402
from resihp_core.job import JobSpec  # noqa: E402
from resihp_core.plan import ParallelPlan, Topology  # noqa: E402
from resihp_core.runtime.controller.resilient import ResilientConfig, run_resilient  # noqa: E402
from resihp_core.testing.conformance import _assemble, run_scenario  # noqa: E402

from .backend_harness import read_dumps, tmpdir  # noqa: E402
from .test_chaos import DETECTOR  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

KILL_AT, EVERY, KEEP, ITERATIONS = 10, 4, 2, 12
DS_DIR = Path(__file__).resolve().parents[1] / "adapters" / "deepspeed"


def _planner(plan: ParallelPlan, topology: Topology, caps):
    from resihp_core.predictor.corpus import CorpusSpec, iteration_workload
    from resihp_core.predictor.cost import CostModel, LinkModel, StageCost
    from resihp_core.predictor.predict import IterationPredictor, ModelShape, workload_features
    from resihp_core.scheduler.planner import Planner
    from resihp_core.scheduler.state import PlannerState

    corpus = CorpusSpec(scale=3.0, shape=0.8, min_len=2, max_len=16, token_budget=16)
    cost = CostModel.uniform(StageCost(alpha_f=2e-5, beta_f=2e-8, alpha_b=4e-5, beta_b=4e-8,
                                       ref_layers=plan.layers(0), ref_tp=1), plan.pp)
    pred = IterationPredictor(cost, topology, ModelShape(tokens=16, hidden=16, params_per_layer=10_000),
                              LinkModel(intra_bandwidth=2e9, inter_bandwidth=1e9))
    feats = workload_features(iteration_workload(corpus, 0, plan.dp, plan.num_microbatches),
                              plan.dp, plan.num_microbatches)
    return PlannerState.create(topology, plan, pred, feats, capabilities=caps), Planner(capabilities=caps)


def _killed_at_10(spec: JobSpec, plan: ParallelPlan, caps, victims: list[int]):
    """Run ``spec`` under the supervisor with ``victims`` SIGKILLed at iteration 10."""
    spec = dataclasses.replace(spec, dump_dir=tmpdir(), checkpoint_dir=tmpdir(), checkpoint_every=EVERY,
                               checkpoint_keep=KEEP, faults=[fail_at(v, KILL_AT, "kill").to_dict() for v in victims])
    topology = Topology.uniform(2, len(plan.devices()) // 2)
    state, planner = _planner(plan, topology, caps)
    run = run_resilient(ResilientConfig(spec=spec, plan=plan, topology=topology, state=state, planner=planner,
                                        detector=DETECTOR, iterations=ITERATIONS, workdir=Path(tmpdir()), timeout_s=360))
    assert run.ok, f"{run.error}; logs in {run.logs}"
    assert len(run.records) == ITERATIONS
    return spec, run


def _check_resumed_from_7(spec: JobSpec, run) -> None:
    """The restore loaded iteration 7's checkpoint and resumed at 8; no plan after the
    kill started earlier (iterations 0-7 are not trained again). A fail-slow plan before
    the kill (host contention on a loaded machine) is not part of the restore."""
    failed = [i for i, e in enumerate(run.events) if e["kind"] == "failure" and e.get("failure") == "fail-stop"]
    assert failed, run.events
    plans = [e for e in run.events[failed[0]:] if e["kind"] == "plan"]
    restores = [e for e in plans if e.get("restore") is not None]
    assert restores, [e["text"] for e in run.events]
    assert restores[0]["restore"] == KILL_AT - KILL_AT % EVERY - 1 == 7
    assert restores[0]["resume"] == 8 and "resumed from the checkpoint of iteration 7" in restores[0]["text"]
    assert restores[0]["iteration"] >= KILL_AT  # labelled where the job was, not where it resumed
    assert all(e["resume"] >= 8 for e in plans), [(e["resume"], e["text"]) for e in plans]
    assert not any("initial state" in e["text"] for e in run.events)
    # Retention: the newest KEEP complete checkpoints (11, the last, and 7); 3 is gone.
    assert [c.iteration for c in checkpoints.scan(spec.checkpoint_dir)] == [11, 7], \
        checkpoints.scan(spec.checkpoint_dir)
    assert all(c.complete for c in checkpoints.scan(spec.checkpoint_dir))


def _max_rel_err(got: dict, want: dict) -> float:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return max(float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))
               for k in want for a, b in zip(got[k], want[k]))


def test_torch_native_fsdp2_shard_lost_restores_from_iteration_7():
    from resihp_adapters.torch_native.plugin import CAPABILITIES

    from .test_torch_native import DATA, MODEL, reference

    plan = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=2)
    spec = JobSpec(adapter="torch_native", adapter_config={"model": MODEL, "shard": 0}, data=DATA,
                   dp=2, num_microbatches=2, seed=0, timeout_s=10.0)
    spec, run = _killed_at_10(spec, plan, CAPABILITIES, victims=[plan.group(1, 0)[0]])
    _check_resumed_from_7(spec, run)
    ref, ref_losses = reference(ITERATIONS, dp=2, m=2)
    dumps = read_dumps(spec)
    assert all(d["iteration"] == ITERATIONS for d in dumps.values())
    state = {k: tuple(v) for k, v in _assemble(dumps).items()}
    assert _max_rel_err(state, ref) <= 1e-9
    assert [r.loss for r in run.records] == pytest.approx(ref_losses, rel=1e-9)


@pytest.mark.deepspeed
def test_deepspeed_killed_rank_restores_from_iteration_7(monkeypatch):
    pytest.importorskip("deepspeed")
    from resihp_adapters.deepspeed.plugin import CAPABILITIES

    # The workers import the test model (_model.py) by name: agents pass the environment on.
    monkeypatch.setenv("PYTHONPATH", ":".join(p for p in (str(DS_DIR), os.environ.get("PYTHONPATH", "")) if p))
    monkeypatch.syspath_prepend(str(DS_DIR))
    plan = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=6, num_microbatches=2)
    spec = JobSpec(adapter="deepspeed", adapter_config={"model": "_model:build", "lr": 1e-3, "num_layers": 6},
                   dp=2, num_microbatches=2, timeout_s=10.0)
    # ZeRO 0 keeps a whole copy per replica: stage 1 loses every copy only when both
    # its devices die (one of them the checkpoints' writer).
    spec, run = _killed_at_10(spec, plan, CAPABILITIES, victims=[plan.group(0, 1)[0], plan.group(1, 1)[0]])
    _check_resumed_from_7(spec, run)
    want = run_scenario(dataclasses.replace(spec, faults=[]), plan, None, iterations=ITERATIONS,
                        env={"PYTHONPATH": os.environ["PYTHONPATH"], "OMP_NUM_THREADS": "1"}, timeout=300)
    got = _assemble(read_dumps(spec))
    assert _max_rel_err(got, want.state) <= 1e-9
    assert [r.loss for r in run.records] == pytest.approx(want.losses, rel=1e-9)


def test_megatron_ref_whole_stage_lost_restores_from_peer_memory_not_disk():
    """TP1 x PP2 x DP1 on two nodes (one device each) keeping memory copies every
    iteration and writing no checkpoint at all: stage 1's only device is SIGKILLed at
    iteration 5. Its copy is held in device 0's memory (its buddy on the other node), so
    the supervisor restores from memory -- no checkpoint file exists to read -- at most
    the iterations since that copy are trained again, and the job ends with the
    fault-free run's complete state (float64)."""
    from resihp_adapters.megatron_ref import state as mstate

    from .backend_harness import Finished, check_against_reference, job_spec, uniform
    from .test_chaos import _planner_state

    kill_at, iterations = 5, 8
    plan = uniform(1, 2, 1, 2)
    victim = plan.group(0, 1)[0]
    spec = job_spec(dp=1, m=2, dump_dir=tmpdir(), memory_copy_every=1,
                    faults=[fail_at(victim, kill_at, "kill").to_dict()])
    assert spec.checkpoint_dir is None and spec.checkpoint_every == 0  # nothing on disk to restore from
    topology = Topology.uniform(2, 1)
    state, planner = _planner_state(plan, topology)
    run = run_resilient(ResilientConfig(spec=spec, plan=plan, topology=topology, state=state, planner=planner,
                                        detector=DETECTOR, iterations=iterations, workdir=Path(tmpdir()),
                                        timeout_s=300))
    assert run.ok, f"{run.error}; logs in {run.logs}"
    assert len(run.records) == iterations
    texts = [e["text"] for e in run.events]
    story = "\n".join(texts) + f"\n(logs in {run.logs})"
    chosen = [e for e in run.events if e["kind"] == "checkpoint" and "memory copies held by" in e["text"]]
    assert chosen, story
    restored = chosen[0]["restore"]
    # The victim died before handing over its copy of iteration 4: the newest one its
    # buddy holds is of 3 (2 if 3's was still on the wire). Iterations after it re-run.
    assert kill_at - 3 <= restored <= kill_at - 2, story
    plans = [e for e in run.events if e["kind"] == "plan" and e.get("restore") is not None]
    assert plans and plans[0]["restore"] == restored and plans[0]["resume"] == restored + 1, story
    assert "resumed from the memory copies" in plans[0]["text"], plans[0]["text"]
    assert not any("initial state" in t or "from a checkpoint on disk" in t for t in texts), story
    dumps = read_dumps(spec)
    assert set(dumps) == {plan.group(0, 0)[0]}
    (survivor,) = dumps.values()
    comps = {mstate.component_of(n) for n in survivor["state"]}
    assert comps == {"embed", "head", *(f"layers.{i}" for i in range(4))}  # the whole model, restaged
    assert survivor["full"]["optimizer.step"] == iterations
    check_against_reference(Finished(spec, dumps, [r.loss for r in run.records], []), iterations)
