"""The engine's per-iteration snapshot reuses its buffers (docs/benchmarks.md) and still
rolls back exactly, one snapshot deep or two (the worker's overlapped commit,
docs/torch_native.md): one process, world of 1 (gloo), float64."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from resihp_core.job import JobSpec  # noqa: E402
from resihp_core.plan import ParallelPlan  # noqa: E402
from resihp_core.predictor.schedules import emit_programs  # noqa: E402
from resihp_adapters.torch_native.data import Batches, job_source  # noqa: E402
from resihp_adapters.torch_native.engine import TorchNativeEngine  # noqa: E402
from resihp_adapters.torch_native.model import LlamaConfig  # noqa: E402


def _state(eng: TorchNativeEngine) -> dict[str, tuple[torch.Tensor, ...]]:
    return {k: (h.param.clone(), *(h.sharded[x].clone() for x in sorted(h.sharded)),
                *(v.clone() for _, v in sorted(h.other.items())))
            for k, h in eng.local_shards().items()}


def _engine() -> tuple[TorchNativeEngine, object]:
    cfg = LlamaConfig(vocab_size=32, dim=8, n_layers=2, n_heads=2, ffn_dim=16, dtype="float64")
    job = JobSpec(adapter="torch_native", adapter_config={}, data={"source": "synthetic", "token_budget": 16},
                  dp=1, num_microbatches=2)
    eng = TorchNativeEngine(0, cfg, Batches(job_source(job, 32), torch.float64), dist.HashStore(),
                            shard_degree=1, lr=0.01, weight_decay=0.0)
    plan = ParallelPlan.uniform(tp=1, pp=1, dp=1, num_layers=2, num_microbatches=2)
    eng.rebuild(plan, 0, [0])
    eng.start_fresh()
    return eng, {(p.replica, p.stage): p for p in emit_programs(plan)}[(0, 0)]


def _equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert all(torch.equal(x, y) for x, y in zip(got[k], want[k])), k


@pytest.mark.timeout(120)
def test_snapshot_buffers_are_reused_and_rollback_is_exact():
    eng, prog = _engine()
    try:
        for i in range(2):  # the optimizer's state exists from the first step on
            eng.snapshot()
            eng.run(prog, i)
        eng.snapshot()
        buffers = eng._snapshots[-1][0]
        before = _state(eng)
        eng.run(prog, 2)
        eng.snapshot()  # the same buffers, now holding the state after iteration 2
        assert eng._snapshots[-1][0] is buffers and len(eng._snapshots) == 1
        after = _state(eng)
        assert any(not torch.equal(a[0], b[0]) for a, b in zip(before.values(), after.values()))
        eng.run(prog, 3)
        eng.rollback()  # back to the state after iteration 2, exactly
        assert eng.iteration == 3
        _equal(_state(eng), after)
    finally:
        eng.release()


@pytest.mark.timeout(120)
def test_two_snapshots_roll_back_past_a_stepped_iteration_exactly():
    """Two kept (the commit of iteration 2 in flight while 3 runs): a refused commit of
    2 puts back the state before 2 although 3 has stepped too; a refused 3 (2
    committed) the state before 3. The two buffers alternate, none is cloned anew."""
    eng, prog = _engine()
    try:
        eng.keep_snapshots(2)
        for i in range(2):
            eng.snapshot()
            eng.run(prog, i)
        eng.snapshot()
        before2 = _state(eng)
        eng.run(prog, 2)
        eng.snapshot()
        before3 = _state(eng)
        buffers = {id(h) for h, _ in eng._snapshots}
        assert [step for _, step in eng._snapshots] == [2, 3]
        eng.run(prog, 3)
        eng.rollback_to(2)  # 2 refused while 3 had stepped: two steps back
        assert eng.iteration == 2 and [step for _, step in eng._snapshots] == [2]
        _equal(_state(eng), before2)
        eng.run(prog, 2)  # again; 3 begins while 2's commit is in flight
        eng.snapshot()
        _equal(_state(eng), before3)  # the same step again: the same state
        assert [step for _, step in eng._snapshots] == [2, 3] and {id(h) for h, _ in eng._snapshots} == buffers
        eng.run(prog, 3)
        eng.rollback_to(3)  # 2 committed, 3 refused: one step back
        assert eng.iteration == 3
        _equal(_state(eng), before3)
        with pytest.raises(RuntimeError, match="no snapshot of iteration 1"):
            eng.rollback_to(1)
    finally:
        eng.release()


@pytest.mark.timeout(120)
def test_a_snapshot_taken_after_the_step_reads_the_fingerprint_of_that_state():
    """The worker's overlapped commit takes the next iteration's snapshot right after a
    step, with the SDC fingerprint read during the copy (docs/sdc.md "What it costs"):
    the sums give the digest a separate pass gives, on the copy plan's path and on the
    first (cloning) snapshot alike, and both kept snapshots still roll back exactly."""
    from torch.distributed.tensor import DTensor

    from resihp_core.detector.sdc import digest_windows, seal, tensor_digest

    eng, prog = _engine()

    def named() -> tuple[list, list]:
        local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
        ps, st = [], []
        for name, p in eng.module.named_parameters():
            ps.append((name, local(p)))
            state = eng.optimizer.state.get(p, {})
            st += [(f"{k}.{name}", local(state[k])) for k in sorted(state) if isinstance(state[k], torch.Tensor)]
        return ps, st

    try:
        eng.keep_snapshots(2)
        eng.snapshot()
        for i in range(6):
            before = _state(eng)
            eng.run(prog, i)
            ps, st = named()
            want = tensor_digest(ps, turn=eng.iteration, state=st, rounds=3)
            labels, views = digest_windows(ps, turn=eng.iteration, state=st, rounds=3)
            assert seal(labels, eng.snapshot(views)) == want, i  # the snapshot of iteration i + 1
            assert eng._snapshots[-1][1] == i + 1
            if i == 4:  # i's commit refused while nothing else stepped: back to i's start
                eng.rollback_to(i)
                _equal(_state(eng), before)
                eng.run(prog, i)
                ps, st = named()
                labels, views = digest_windows(ps, turn=eng.iteration, state=st, rounds=3)
                assert seal(labels, eng.snapshot(views)) == want  # the same step again, the same bits
    finally:
        eng.release()


@pytest.mark.timeout(120)
def test_the_fingerprints_windows_planned_once_per_layout_equal_a_fresh_walk():
    """The adapter plans what the fingerprint reads once per layout and rotation phase
    (``_FingerprintWindows``): at every step its windows give the digest a fresh walk of
    the module and optimizer state gives, through the state's appearance at the first
    step and an optimizer-state tensor replaced by another object."""
    from torch.distributed.tensor import DTensor

    from resihp_adapters.torch_native.adapter import _FingerprintWindows
    from resihp_core.detector.sdc import seal, tensor_digest, window_sum

    eng, prog = _engine()
    local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731

    def fresh() -> str:
        ps, st = [], []
        for name, p in eng.module.named_parameters():
            ps.append((f"param.{name}", local(p)))
            state = eng.optimizer.state.get(p, {})
            st += [(f"{k}.{name}", local(state[k])) for k in sorted(state) if isinstance(state[k], torch.Tensor)]
        return tensor_digest(ps, share=0.5, turn=eng.iteration, state=st, rounds=3)

    planned = _FingerprintWindows()
    walks = []
    plan_anew = planned._plan
    planned._plan = lambda e: walks.append(e.iteration) or plan_anew(e)
    try:
        for i in range(8):
            labels, views = planned.get(eng, 0.5, 3)
            assert seal(labels, [window_sum(v) for v in views]) == fresh(), i
            if i == 5:
                p = next(iter(eng.module.parameters()))
                old = eng.optimizer.state[p]["exp_avg"]
                eng.optimizer.state[p]["exp_avg"] = DTensor.from_local(
                    old.to_local().clone() + 1.0, old.device_mesh, old.placements, run_check=False,
                    shape=old.shape, stride=old.stride())
                labels, views = planned.get(eng, 0.5, 3)
                assert seal(labels, [window_sum(v) for v in views]) == fresh()
            eng.run(prog, i)
        assert walks == [0, 1, 5], walks  # first, once the optimizer state exists, after the replacement
    finally:
        eng.release()


@pytest.mark.timeout(120)
def test_snapshot_copy_plan_is_reused_and_follows_replaced_state():
    """The snapshot's copy plan is made once per buffers and reused; an optimizer-state
    tensor replaced by another object (not updated in place) is noticed: the snapshot
    then holds the new tensor's values and a rollback puts them back exactly."""
    from torch.distributed.tensor import DTensor

    eng, prog = _engine()
    slow = []
    plan_anew = eng._copy_into_slow
    eng._copy_into_slow = lambda held: slow.append(id(held)) or plan_anew(held)
    try:
        eng.keep_snapshots(2)
        for i in range(5):  # buffers taken before the first step hold no optimizer state: replaced
            eng.snapshot()
            eng.run(prog, i)
        planned = len(slow)
        for i in range(5, 8):
            eng.snapshot()
            eng.run(prog, i)
        assert len(slow) == planned, "the rotating buffers' copy plans were made again"
        p = next(iter(eng.module.parameters()))
        old = eng.optimizer.state[p]["exp_avg"]
        assert isinstance(old, DTensor)
        eng.optimizer.state[p]["exp_avg"] = DTensor.from_local(
            old.to_local().clone() + 1.0, old.device_mesh, old.placements, run_check=False,
            shape=old.shape, stride=old.stride())
        eng.snapshot()
        assert len(slow) == planned + 1  # the plan no longer matched: made again
        want = _state(eng)
        eng.run(prog, 8)
        eng.rollback_to(8)
        _equal(_state(eng), want)
    finally:
        eng.release()


@pytest.mark.timeout(120)
def test_recursive_fsdp_flags_reach_every_group_without_walking_the_stage():
    """The stage's recursive FSDP flag setters (torch's PipelineStage calls them around
    every backward chunk) set every FSDP group of the stage from the list made when it
    was wrapped, not by listing its submodules; training still steps. On this stage
    (shard degree 1) the replica reduction owns the gradient sync: FSDP's stays off."""
    eng, prog = _engine()
    try:
        m = eng.module

        def walked():
            raise AssertionError("walked the stage's submodules")

        object.__setattr__(m, "modules", walked)
        try:
            m.set_requires_gradient_sync(False)
            m.set_reshard_after_backward(False)
        finally:
            object.__delattr__(m, "modules")
        groups = [g for sub in m.modules() if hasattr(sub, "_get_fsdp_state")
                  for g in sub._get_fsdp_state()._fsdp_param_groups]
        assert groups and all(not g.reduce_grads and not g.all_reduce_grads and not g.reshard_after_backward
                              for g in groups)
        m.set_requires_gradient_sync(True)
        m.set_reshard_after_backward(True)
        assert all(not g.reduce_grads and not g.all_reduce_grads and g.reshard_after_backward for g in groups)
        before = _state(eng)
        eng.run(prog, 0)
        assert any(not torch.equal(a[0], b[0]) for a, b in zip(before.values(), _state(eng).values()))
    finally:
        eng.release()


@pytest.mark.timeout(120)
def test_optimizer_step_on_local_tensors_equals_the_dtensor_step_bitwise():
    """The engine steps AdamW on the DTensors' local tensors once their state exists,
    on the host in groups of at most ``HOST_STEP_ELEMENTS`` (cut small here, so the
    stage's tensors are stepped in several groups, one larger tensor alone); parameters
    and both moments equal an engine stepping the DTensors, bit for bit."""
    import resihp_adapters.torch_native.engine as engine_mod

    runs = []
    for local in (True, False):
        eng, prog = _engine()
        used: list[bool] = []
        cuts: list[list[tuple[int, int]]] = []  # per step: (elements, tensors) of each group
        view, chunks, limit = engine_mod._local_view, engine_mod._host_chunks, engine_mod.HOST_STEP_ELEMENTS

        def counted(opt):
            v = view(opt)
            used.append(v is not None)
            return v

        def cut(ps):
            out = chunks(ps)
            cuts.append([(sum(p.numel() for p in c), len(c)) for c in out])
            return out

        engine_mod._local_view = counted if local else (lambda opt: None)
        engine_mod._host_chunks, engine_mod.HOST_STEP_ELEMENTS = cut, 100
        try:
            for i in range(4):
                eng.run(prog, i)
            runs.append(_state(eng))
        finally:
            engine_mod._local_view, engine_mod._host_chunks, engine_mod.HOST_STEP_ELEMENTS = view, chunks, limit
            eng.release()
        if local:
            assert used == [False, True, True, True]  # the first step makes the state (DTensors)
            assert len(cuts) == 3 and cuts[0] == cuts[1] == cuts[2]
            assert all(n <= 100 or k == 1 for n, k in cuts[0])  # over the limit only alone
            assert any(k > 1 for _, k in cuts[0]) and any(n > 100 for n, _ in cuts[0]), cuts[0]
    _equal(runs[0], runs[1])


@pytest.mark.timeout(120)
def test_a_replica_stage_reduces_in_reused_buckets_bitwise_like_fsdp_and_drops_a_failed_iteration():
    """Shard degree 1: gradients are reduced in the replica reducer's buckets (here
    several, reused every iteration: the gradients are views of the same buffers), and
    parameters and both moments equal FSDP's own reduction bit for bit (a world of 1).
    An iteration that fails after its backward (a peer's death noticed before the
    reduction is waited for) and is rolled back leaves no count behind: run again, it
    trains the same bits."""
    import functools

    import resihp_adapters.torch_native.engine as engine_mod
    from resihp_adapters.torch_native.replica_reduce import ReplicaReducer

    runs = []
    for mode in ("fsdp", "buckets", "failed"):
        made = engine_mod.ReplicaReducer
        engine_mod.ReplicaReducer = ((lambda *a, **k: None) if mode == "fsdp"
                                     else functools.partial(ReplicaReducer, bucket_bytes=2048))
        try:
            eng, prog = _engine()
        finally:
            engine_mod.ReplicaReducer = made
        try:
            red = eng._reducer
            assert (red is None) == (mode == "fsdp")
            buffers = None if red is None else [b.data_ptr() for b in red.buffers()]
            if red is not None:
                assert len(buffers) > 2  # the stage spans several buckets
            for i in range(4):
                eng.snapshot()
                if mode == "failed" and i == 2:
                    real = eng.finish_grads
                    eng.finish_grads = lambda: (_ for _ in ()).throw(RuntimeError("peer died"))
                    with pytest.raises(RuntimeError, match="peer died"):
                        eng.run(prog, i)
                    eng.finish_grads = real
                    eng.rollback()
                    assert eng.iteration == 2
                eng.run(prog, i)
                if red is not None:
                    views = {g._local_tensor.untyped_storage().data_ptr() for g in
                             (p.grad for p in eng.module.parameters()) if g is not None}
                    assert views <= set(buffers) and [b.data_ptr() for b in red.buffers()] == buffers
            runs.append(_state(eng))
        finally:
            eng.release()
    _equal(runs[1], runs[0])
    _equal(runs[2], runs[0])


def _trained(iterations: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """The state after ``iterations`` plain iterations (the step inside ``run``)."""
    eng, prog = _engine()
    try:
        for i in range(iterations):
            eng.run(prog, i)
        return _state(eng)
    finally:
        eng.release()


@pytest.mark.timeout(120)
def test_the_step_after_the_commit_leaves_the_state_alone_until_applied():
    """``defer_steps(True)`` (docs/worker-protocol.md, "The step after the commit"):
    ``run`` stops before the optimizer step and keeps no snapshot; a rollback drops the
    gradients, and the attempt run again and applied steps exactly as a plain run."""
    want = _trained(3)
    eng, prog = _engine()
    try:
        assert eng.defer_steps(True)
        eng.run(prog, 0)
        eng.apply_step()
        before = _state(eng)
        eng.run(prog, 1)
        _equal(_state(eng), before)  # reduced gradients only: no step taken
        eng.rollback()  # the commit was refused
        assert eng.iteration == 1 and not eng._snapshots
        assert all(p.grad is None for p in eng.module.parameters())
        with pytest.raises(RuntimeError, match="no iteration's optimizer step is pending"):
            eng.apply_step()
        for i in (1, 2):
            eng.run(prog, i)
            eng.apply_step()
        assert eng.iteration == 3
        _equal(_state(eng), want)
    finally:
        eng.release()


@pytest.mark.timeout(120)
def test_a_stage_rebuilt_in_the_same_layout_takes_its_kept_state_without_a_copy():
    """A re-plan that keeps this rank's stage whole (shard degree 1): the optimizer
    state it kept at release becomes the new stage's, the same memory, and training
    goes on exactly."""
    want = _trained(3)
    eng, prog = _engine()
    try:
        for i in range(2):
            eng.run(prog, i)
        plan = eng.plan
        eng.release()
        kept = {k: {x: t.data_ptr() for x, t in h.sharded.items()} for k, h in eng._kept[1].items()}
        assert kept and all(kept.values())
        eng.rebuild(plan, 1, [0])
        assert eng.move_state(plan, plan, {0}, 2) == 0
        now = {eng.canonical(n): {x: v.to_local().data_ptr() for x, v in eng.optimizer.state[p].items()
                                  if x in kept[eng.canonical(n)]}
               for n, p in eng.module.named_parameters()}
        assert now == kept
        eng.run(prog, 2)
        _equal(_state(eng), want)
    finally:
        eng.release()
