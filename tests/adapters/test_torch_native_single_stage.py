"""A one-stage program (pp = 1) runs on the engine's own loop (``SingleStage``) instead
of torch's pipeline runtime, and trains exactly as the runtime does: the same state bit
for bit, the same losses and per-micro-batch timings booked. One process, world of 1
(gloo), float64."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from resihp_core.job import JobSpec  # noqa: E402
from resihp_core.plan import ParallelPlan  # noqa: E402
from resihp_core.predictor.schedules import emit_programs  # noqa: E402
from resihp_adapters.torch_native import engine as engine_mod  # noqa: E402
from resihp_adapters.torch_native.data import Batches, job_source  # noqa: E402
from resihp_adapters.torch_native.engine import SingleStage, TorchNativeEngine  # noqa: E402
from resihp_adapters.torch_native.lowering import lower_program  # noqa: E402
from resihp_adapters.torch_native.model import LlamaConfig  # noqa: E402


def _train(schedule: str, iterations: int = 3) -> tuple[type, dict[str, torch.Tensor], list[float], list[dict]]:
    cfg = LlamaConfig(vocab_size=32, dim=8, n_layers=2, n_heads=2, ffn_dim=16, dtype="float64")
    job = JobSpec(adapter="torch_native", adapter_config={}, data={"source": "synthetic", "token_budget": 16},
                  dp=1, num_microbatches=3)
    eng = TorchNativeEngine(0, cfg, Batches(job_source(job, 32), torch.float64), dist.HashStore(),
                            shard_degree=1, lr=0.01, weight_decay=0.0)
    plan = ParallelPlan.uniform(tp=1, pp=1, dp=1, num_layers=2, num_microbatches=3, schedule=schedule)
    prog = emit_programs(plan)[0]
    try:
        eng.rebuild(plan, 0, [0])
        eng.start_fresh()
        losses, booked = [], []
        for i in range(iterations):
            res = eng.run(prog, i)
            losses.append(res.loss)
            booked.append({"forward": sorted(res.forward_s), "backward": sorted(res.backward_s)})
        state = {}
        for name, held in eng.local_shards().items():
            state[name] = held.param.clone()
            state.update({f"{name}/{k}": v.clone() for k, v in held.sharded.items()})
        return type(eng.schedule), state, losses, booked
    finally:
        eng.release()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_one_stage_program_skips_torchs_runtime_and_trains_bit_for_bit_as_it_does(monkeypatch, schedule):
    kind, state, losses, booked = _train(schedule)
    assert kind is SingleStage
    monkeypatch.setattr(engine_mod.SingleStage, "runs", staticmethod(lambda actions: False))
    kind_rt, state_rt, losses_rt, booked_rt = _train(schedule)
    assert kind_rt is not SingleStage  # torch's _PipelineScheduleRuntime
    assert losses == losses_rt
    assert state.keys() == state_rt.keys() and any(k.endswith("exp_avg") for k in state)
    for k in state:
        assert torch.equal(state[k], state_rt[k]), k
    # every micro-batch's forward and backward is timed for the profiles, as under the runtime
    assert booked == booked_rt == [{"forward": [0, 1, 2], "backward": [0, 1, 2]}] * 3


def test_a_split_backward_keeps_torchs_runtime():
    def one_stage(schedule: str) -> list:
        plan = ParallelPlan.uniform(tp=1, pp=1, dp=1, num_layers=2, num_microbatches=2, schedule=schedule)
        return lower_program(emit_programs(plan)[0])

    assert SingleStage.runs(one_stage("1f1b")) and SingleStage.runs(one_stage("gpipe"))
    split = one_stage("zbh1")  # input and weight gradients apart: I0 W0
    assert [str(a) for a in split][2:4] == ["0I0", "0W0"]
    assert not SingleStage.runs(split)


@pytest.mark.timeout(120)
def test_the_users_exception_in_a_one_stage_forward_is_raised_as_theirs():
    """Their error as they raised it, of the job kind, with the line of their code the
    console names; the failed iteration is discarded."""
    from resihp_core.errors import classify, user_frame

    cfg = LlamaConfig(vocab_size=32, dim=8, n_layers=2, n_heads=2, ffn_dim=16, dtype="float64")
    job = JobSpec(adapter="torch_native", adapter_config={}, data={"source": "synthetic", "token_budget": 16},
                  dp=1, num_microbatches=3)
    eng = TorchNativeEngine(0, cfg, Batches(job_source(job, 32), torch.float64), dist.HashStore(),
                            shard_degree=1, lr=0.01, weight_decay=0.0)
    plan = ParallelPlan.uniform(tp=1, pp=1, dp=1, num_layers=2, num_microbatches=3)

    def their_forward(*args, **kwargs):
        raise ValueError("their bug")

    try:
        eng.rebuild(plan, 0, [0])
        eng.start_fresh()
        eng.defer_steps(True)  # as the worker runs a DP replica: a failed iteration is discarded
        eng.module.forward = their_forward
        with pytest.raises(ValueError, match="their bug") as got:
            eng.run(emit_programs(plan)[0], 0)
        assert classify(got.value) == "job"
        assert "test_torch_native_single_stage.py" in user_frame(got.value)
        eng.rollback()
    finally:
        eng.release()
