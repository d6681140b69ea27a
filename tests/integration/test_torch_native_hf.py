"""The user's own Hugging Face model on torch_native: a tiny LlamaForCausalLM (grouped-
query attention, tied embeddings) and a tiny Qwen2 (biased projections, untied head),
each with the user's AdamW, a LambdaLR warm-up and clipping at 1.0, over a dataset of
local text. PP2 x DP2 (4 worker processes, gloo, float64): the resilient engine and the
stock path (Schedule1F1B + fully_shard) both equal one process running the whole model
with torch's own clip_grad_norm_ (losses and the complete final state: parameters,
every optimizer state entry, learning rate, scheduler position), and so does the engine
after losing a device half-way and going on as pp3 over the other three. The same
processes then run the LLaMA with tensor parallelism, TP2 x PP2 x DP1 (DTensor, the
model's own TP plan): the engine and stock torch (parallelize_module + PipelineStage +
Schedule1F1B) equal the same single process."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Callable

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import torch.distributed as dist  # noqa: E402

from resihp_core.plan import ParallelPlan  # noqa: E402

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "examples" / "hf_llama"))
TEXT = ROOT / "docs" / "torch_native.md"
TOL = 1e-9


def compare_states(got: dict, ref: dict) -> float:
    """Largest relative difference over every entry (tensors by max-abs, numbers
    exactly); the key sets must be equal."""
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))[:10]
    worst = 0.0
    for k, want in ref.items():
        have = got[k]
        if isinstance(want, torch.Tensor):
            have = torch.as_tensor(have)
            scale = float(want.double().abs().max().clamp_min(1e-300)) if want.numel() else 1.0
            err = float((have.double() - want.double()).abs().max()) / scale if want.numel() else 0.0
            worst = max(worst, err)
        elif isinstance(want, float):
            worst = max(worst, abs(float(have) - want) / max(abs(want), 1e-300))
        else:
            assert have == want, (k, have, want)
    return worst


def reference(kind: str, iterations: int, global_microbatches: int, text: Path = TEXT,
              model_loss: bool = False) -> tuple[dict, list[float]]:
    """The single-process run of the user's model, in a fresh interpreter: the pytest
    process carries global torch / transformers state from earlier tests (after the
    whole suite, the in-process run started from a different first loss).
    ``model_loss``: each micro-batch's loss is the model's own (``outputs.loss``: HF's
    mean cross-entropy, computed in float32), weighted 1 / G, as the user's loop takes it."""
    return references([(kind, iterations, global_microbatches, text, model_loss)])[0]


def references(runs: list[tuple[str, int, int, Path, bool]]) -> list[tuple[dict, list[float]]]:
    """Several :func:`reference` runs (its arguments, in order) in one fresh interpreter,
    one after the other: the interpreter's start-up (torch, transformers) costs more
    CPU than a short run."""
    return start_references(runs)()


def start_references(runs: list[tuple[str, int, int, Path, bool]]) -> Callable[[], list[tuple[dict, list[float]]]]:
    """:func:`references` started now in the background; the call it returns waits for
    them. A test starts them before its job: a job leaves a core idle while one process
    starts (its launcher, imports) or tears down."""
    import shutil
    import subprocess
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="resihp-hf-reference-"))
    out, spec = d / "references.pt", d / "runs.json"
    spec.write_text(json.dumps([[k, i, g, str(t), bool(ml)] for k, i, g, t, ml in runs]))
    code = ("import json, sys, torch; sys.path[:0] = [sys.argv[1], sys.argv[2]]; "
            "from test_torch_native_hf import _reference_here; "
            "torch.save([_reference_here(k, i, g, t, ml) for k, i, g, t, ml in json.load(open(sys.argv[3]))], "
            "sys.argv[4])")
    proc = subprocess.Popen([sys.executable, "-c", code, str(HERE), str(ROOT / "examples" / "hf_llama"), str(spec),
                             str(out)], cwd=str(ROOT))

    def collect() -> list[tuple[dict, list[float]]]:
        try:
            rc = proc.wait(timeout=600)
            assert rc == 0, f"the single-process reference run exited with {rc}"
            return torch.load(out, weights_only=False)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            shutil.rmtree(d, ignore_errors=True)

    return collect


def _reference_here(kind: str, iterations: int, global_microbatches: int, text: Path,
                    model_loss: bool = False) -> tuple[dict, list[float]]:
    """The single-process run itself (in the interpreter :func:`reference` starts)."""
    from hf_model import TextWindows, adamw, tiny_model, warmup_cosine

    from resihp_adapters.torch_native.api import user_job
    from resihp_adapters.torch_native.reference import user_single_process_run

    torch.set_num_threads(1)
    model = tiny_model(kind)
    loss_fn = None
    if model_loss:  # what the HF model computes for outputs.loss; a user's loss_fn is a mean, weighted 1 / G
        from transformers.loss.loss_utils import ForCausalLMLoss

        vocab = model.config.vocab_size
        loss_fn = lambda logits, labels: ForCausalLMLoss(logits, labels, vocab)  # noqa: E731
    user = user_job(model, optimizer=adamw, lr_scheduler=warmup_cosine(iterations), max_grad_norm=1.0,
                    dataset=TextWindows(text, 16), micro_batch_size=2, loss_fn=loss_fn)
    return user_single_process_run(user.stages, user.recipe, user.data(global_microbatches), iterations)


CASES = [  # (kind, FSDP shard degree, how the survivors get the state)
    ("llama", 0, "restore"),  # FSDP2: losing device 1 loses a shard -> DCP; tied head stage 1 -> 2
    ("qwen2", 1, "move"),  # HSDP: the survivors move the state from memory
]


@pytest.mark.timeout(900)
def test_hf_models_pp2_dp2_equal_stock_path_and_single_process(tmp_path):
    """Both models in one set of 4 processes (startup dominates the cost)."""
    from .test_torch_native import run_devices

    iterations, m = 4, 2
    plan = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=m)
    after = ParallelPlan(num_layers=4, layer_ranges=((0, 1), (1, 2), (2, 4)), tp_groups=(((0,), (2,), (3,)),),
                         num_microbatches=plan.dp * m)
    cases = [{"kind": kind, "shard": shard, "plan": plan.to_text(), "iterations": iterations, "text": str(TEXT),
              "out": str(tmp_path), "recover": recover, "plan_after": after.to_text()}
             for kind, shard, recover in CASES]
    # Tensor parallelism in the same processes: TP2 x PP2 x DP1 over the same global batch
    # (4 micro-batches), so the LLaMA reference serves it too.
    tp_plan = ParallelPlan(num_layers=4, layer_ranges=((0, 2), (2, 4)), tp_groups=(((0, 1), (2, 3)),),
                           num_microbatches=plan.dp * m)
    cases.append({"kind": "llama", "tp": True, "plan": tp_plan.to_text(), "iterations": iterations,
                  "text": str(TEXT), "out": str(tmp_path)})
    (tmp_path / "spec.json").write_text(json.dumps(cases))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    pending = start_references([(kind, iterations, plan.dp * m, TEXT, False) for kind, _, _ in CASES])
    run_devices(lambda d: [str(HERE / "torch_native_hf_job.py"), str(tmp_path / "spec.json"), str(d),
                           str(store.port)], 4, tmp_path, 840)
    refs = dict(zip((kind for kind, _, _ in CASES), pending()))
    for kind, _, _ in CASES:
        check(kind, [torch.load(tmp_path / f"{kind}-{d}.pt", weights_only=False) for d in range(4)], iterations,
              refs[kind])
    # TP2 x PP2 (DTensor, the model's own base_model_tp_plan, GQA heads split 2/1 per rank):
    # the engine's and the stock path's losses and complete final states equal one process.
    check("llama", [torch.load(tmp_path / f"llama-tp-{d}.pt", weights_only=False) for d in range(4)], iterations,
          refs["llama"], tied=False)


def check(kind: str, out: list[dict], iterations: int, ref: tuple[dict, list[float]], tied: bool = True) -> None:
    ref_state, ref_losses = ref
    for key in ("losses", "stock_losses"):
        total = [sum(o[key][i] for o in out if i < len(o[key])) for i in range(iterations)]
        assert all(abs(a - b) <= TOL * abs(b) for a, b in zip(total, ref_losses)), (kind, key, total, ref_losses)
    for key in ("state", "stock_state"):
        merged: dict = {}
        for o in out:
            merged.update(o[key])
        # every stage reports the shared entries (hyper-parameters, scheduler, iteration)
        assert compare_states(merged, ref_state) <= TOL, (kind, key)
    if kind == "llama" and tied:  # the tied weight: one state name; the embedding's and the head's copies equal it
        assert "param/lm_head.weight" not in ref_state and "param/model.embed_tokens.weight" in ref_state
        tied = {k: v for k, v in ref_state.items() if k.startswith(("param/model.embed_tokens.", "optim/model.embed_tokens."))}
        for d in (0, 3):  # pp3: stage 0 (embedding) and stage 2 (head)
            assert compare_states({k: out[d]["state"][k] for k in tied}, tied) <= TOL, d
