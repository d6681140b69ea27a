"""The soak's step-by-step verifier (benchmarks/soak.py): it passes a correct run's
checkpoints, bridges an incomplete one, names the first wrong step or loss, goes back
to the restored checkpoint when the job re-trains, and deletes what it verified; for
every adapter's checkpoint format (soak_formats.py): megatron_ref's components,
torch_native's DCP folder and DeepSpeed's per-layer files, each sealed by the core."""

from __future__ import annotations

import shutil
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import soak  # noqa: E402
import soak_formats  # noqa: E402
import torch  # noqa: E402
from resihp_adapters.megatron_ref.state import component_of  # noqa: E402
from resihp_adapters.torchkit.checkpoint import save_component, write_manifest  # noqa: E402
from resihp_core import checkpoints  # noqa: E402

N = 6


def write_megatron(s: soak.Soak, root: Path, it: int, state: dict) -> None:
    """megatron_ref's layout: one component file per stage part, each hashed by its writer."""
    comps: dict[str, dict] = {}
    for name, ts in state.items():
        comps.setdefault(component_of(name), {})[name] = ts[:3]
    for c, full in comps.items():
        save_component(root, it, c, full)
    write_manifest(root, it, comps)


def write_torch_native(s: soak.Soak, root: Path, it: int, state: dict) -> None:
    """torch_native's layout: the engine's state dicts (model + flattened optimizer)
    saved with DCP into ``dcp/``, then sealed by the core."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

    model, opt = s.fmt._model()
    named = list(model.named_parameters())
    soak_formats._install(opt, named, state)
    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    sd = {"model": get_model_state_dict(model, options=opts), "optim": get_optimizer_state_dict(model, opt, options=opts)}
    dcp.save(sd, checkpoint_id=str(checkpoints.iteration_dir(root, it) / "dcp"), no_dist=True)
    checkpoints.seal(root, it)


def write_deepspeed(s: soak.Soak, root: Path, it: int, state: dict) -> None:
    """DeepSpeed's layout: ``layers/layer_<NNNN>-tp0.pt`` as extract_layers gives them, sealed by the core."""
    d = checkpoints.iteration_dir(root, it) / "layers"
    d.mkdir(parents=True, exist_ok=True)
    layers: dict[int, dict] = {}
    for key, (p, m, v, step) in state.items():
        idx, name = key.split(".", 1)
        st = layers.setdefault(int(idx), {"params": {}, "opt": {}})
        st["params"][name] = p
        st["opt"][name] = {"step": step.float(), "exp_avg": m, "exp_avg_sq": v}
    for idx, st in layers.items():
        torch.save(st, d / f"layer_{idx:04d}-tp0.pt")
    checkpoints.seal(root, it)


WRITERS = {"megatron_ref": write_megatron, "torch_native": write_torch_native, "deepspeed": write_deepspeed}


@pytest.fixture(params=sorted(WRITERS))
def run(request, tmp_path: Path):
    """A soak whose 'job' committed N iterations: checkpoints (in the adapter's format)
    and losses of a fault-free run."""
    s = soak.Soak(2, 0, tmp_path / "work", request.param)
    s.ckpt = tmp_path / "ckpt"
    s.job = types.SimpleNamespace(committed=N, committed_in={})
    states = {}
    for it, loss, st in s.fmt.steps(None, 0, N):
        WRITERS[request.param](s, s.ckpt, it, st)
        s.losses[it] = loss
        states[it] = st
    return s, states


def some_param(states: dict) -> str:
    return sorted(states[0])[len(states[0]) // 2]


def test_a_correct_run_verifies_every_iteration(run) -> None:
    s, _ = run
    s.advance()
    assert s.problems == []
    assert s.verified[0] == N - 1 and s.checked == set(range(N))
    assert s.accounting["loss_checks"] == N and s.accounting["worst_step_error"] < 1e-12


def test_an_incomplete_checkpoint_is_bridged(run) -> None:
    s, _ = run
    (s.ckpt / "iter00000002" / "manifest.json").unlink()
    s.advance()
    assert s.problems == [] and s.checked == set(range(N))


def test_the_first_wrong_step_is_named(run) -> None:
    s, states = run
    bad = {k: tuple(t.clone() for t in v) for k, v in states[3].items()}
    name = some_param(states)
    bad[name][0].mul_(1 + 1e-6)
    shutil.rmtree(checkpoints.iteration_dir(s.ckpt, 3))
    WRITERS[s.adapter](s, s.ckpt, 3, bad)
    s.advance()
    assert s.problems and s.problems[0].startswith("checkpoint 3 ")
    assert f"{name} param" in s.problems[0]


def test_a_wrong_optimizer_moment_or_step_count_is_named(run) -> None:
    s, states = run
    if s.adapter == "megatron_ref":
        pytest.skip("megatron_ref's components carry no AdamW step count")
    bad = {k: tuple(t.clone() for t in v) for k, v in states[2].items()}
    name = some_param(states)
    bad[name] = (*bad[name][:3], bad[name][3] + 1)
    shutil.rmtree(checkpoints.iteration_dir(s.ckpt, 2))
    WRITERS[s.adapter](s, s.ckpt, 2, bad)
    s.advance()
    assert s.problems and s.problems[0].startswith("checkpoint 2 ") and f"{name} step" in s.problems[0]


def test_a_corrupt_file_is_not_complete(run) -> None:
    s, _ = run
    d = checkpoints.iteration_dir(s.ckpt, 4)
    victim = next(p for p in sorted(d.rglob("*")) if p.is_file() and p.name != "manifest.json"
                  and not p.name.endswith(".sha256"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    victim.write_bytes(bytes(data))
    assert not s._complete(4)  # the core's rule: SHA-256 mismatch
    s.advance()
    assert s.checked == set(range(N)) and s.problems == []  # 3 -> 5 bridged by two reference steps


def test_a_wrong_loss_is_named(run) -> None:
    s, _ = run
    s.losses[4] *= 1 + 1e-6
    s.advance()
    assert len(s.problems) == 1 and s.problems[0].startswith("iteration 4 ")
    assert s.accounting["loss_failures"] == 1


def test_a_restore_sends_the_verifier_back(run) -> None:
    s, _ = run
    s.advance()
    shutil.rmtree(s.ckpt / "iter00000004")  # re-trained after the restore: not written yet
    s.job.committed = 4
    s.on_event({"kind": "plan", "resume": 2, "iteration": 2, "generation": 1, "text": "restore (x, y)"})
    s.advance()
    assert s.verified[0] == 3 and s.problems == []


def test_verified_checkpoints_are_deleted_but_the_newest_kept(run, monkeypatch) -> None:
    s, _ = run
    monkeypatch.setattr(soak, "BEHIND", 2)
    s.advance()
    left = sorted(p.name for p in s.ckpt.iterdir())
    assert left == [f"iter{k:08d}" for k in range(N - 1 - 2, N)]
    assert s.worst_between(0, N - 1) is not None and s.worst_between(0, N) is None


@pytest.mark.parametrize("adapter", sorted(WRITERS))
def test_reference_steps_resume_exactly_from_a_state(adapter: str, tmp_path: Path) -> None:
    """Two steps from the state after two equal four steps from the seed: a verified
    checkpoint is a faithful starting point (step count included)."""
    fmt = soak.Soak(2, 0, tmp_path, adapter).fmt
    *_, (_, _, mid) = fmt.steps(None, 0, 2)
    *_, (_, loss_a, a) = fmt.steps(None, 0, 4)
    *_, (_, loss_b, b) = fmt.steps(mid, 2, 4)
    assert loss_a == loss_b and soak.Soak._error(b, a)[0] == 0.0


def test_torch_native_reference_is_the_adapters_own(tmp_path: Path) -> None:
    """The soak's torch_native steps equal the adapter's single_process_run."""
    from resihp_adapters.torch_native.reference import single_process_run

    fmt = soak.Soak(2, 0, tmp_path, "torch_native").fmt
    want, losses = single_process_run(fmt.cfg, fmt.data, 3, lr=fmt.lr, weight_decay=fmt.wd)
    got = list(fmt.steps(None, 0, 3))
    assert [loss for _, loss, _ in got] == losses
    assert soak.Soak._error({k: v[:3] for k, v in got[-1][2].items()}, want)[0] == 0.0
