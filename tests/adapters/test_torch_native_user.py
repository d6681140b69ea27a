"""torch_native with the user's model, in one process: the HF split equals the model's
own forward, names are the model's, tied weights, packed-document masks, data
addressing, the state sources of a tied weight, and what is refused up front."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "hf_llama"))

from hf_model import TextWindows, adamw, tiny_model  # noqa: E402

from resihp_core.plan import ParallelPlan  # noqa: E402
from resihp_adapters.torch_native.api import user_job  # noqa: E402
from resihp_adapters.torch_native.split import Stage, UserStages, hf_decoder_split, tied_names  # noqa: E402

TEXT = Path(__file__).resolve().parents[2] / "docs" / "torch_native.md"


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_stages_chain_to_the_models_own_forward_under_its_own_names(kind):
    model = tiny_model(kind)
    split = hf_decoder_split(model)
    ids = torch.randint(0, 256, (2, 12))
    a, b = Stage(split, model, 0, 1), Stage(split, model, 1, 4)
    assert torch.equal(b(a(ids)), model(ids).logits)
    names = {n for n, _ in a.named_parameters()} | {n for n, _ in b.named_parameters()}
    own = {n for n, _ in model.named_parameters()}
    if kind == "llama":  # tied: the head's copy is the alias on the last stage
        assert tied_names(model) == {"lm_head.weight": "model.embed_tokens.weight"}
        assert names == own | {"lm_head.weight"}
        whole = Stage(split, model, 0, 4)
        assert whole.part("lm_head").weight is whole.part("model.embed_tokens").weight  # one parameter
    else:
        assert tied_names(model) == {} and names == own


def test_packed_documents_attend_within_their_document_only():
    from resihp_adapters.torch_native.data import hf_batch

    ids = torch.arange(6)[None]
    b = hf_batch(torch.float64)({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])})
    allowed = b.kwargs()["attention_mask"][0, 0] == 0
    assert b.lengths == (3, 3)
    assert allowed[4, 3] and allowed[4, 4] and not allowed[4, 2] and not allowed[1, 2]
    model = tiny_model("llama")
    stage = Stage(hf_decoder_split(model), model, 0, 4)
    out = stage(ids, **b.kwargs())  # the second document's logits = it run alone
    alone = stage(ids[:, 3:])
    assert torch.allclose(out[:, 3:], alone, rtol=0, atol=1e-12)


def test_micro_batches_are_addressed_by_global_index_whatever_the_plan():
    user = user_job(tiny_model("llama"), optimizer=adamw, dataset=TextWindows(TEXT, 16), micro_batch_size=2)
    data = user.data(8)
    two = [data.micro_batch(3, r, j, 4).args[0] for r in range(2) for j in range(4)]
    four = [data.micro_batch(3, r, j, 2).args[0] for r in range(4) for j in range(2)]
    assert all(torch.equal(x, y) for x, y in zip(two, four))
    assert not torch.equal(data.micro_batch(3, 0, 0, 4).args[0], data.micro_batch(4, 0, 0, 4).args[0])
    with pytest.raises(ValueError, match="outside the job's global batch"):
        data.micro_batch(0, 2, 0, 4)


def test_a_tied_weight_is_sourced_from_whichever_stage_survives():
    from resihp_adapters.torch_native.engine import TorchNativeEngine
    from resihp_adapters.torch_native.reshard import transfer_plan

    user = user_job(tiny_model("llama"), optimizer=adamw, dataset=TextWindows(TEXT, 16))
    eng = TorchNativeEngine(0, user.stages, None, None, recipe=user.recipe)
    old = ParallelPlan.uniform(tp=1, pp=2, dp=1, num_layers=4, num_microbatches=2)  # devices 0 (s0), 1 (s1)
    new = ParallelPlan(num_layers=4, layer_ranges=((0, 4),), tp_groups=(((1,),),), num_microbatches=2)
    with pytest.raises(Exception, match="no surviving device"):
        transfer_plan(eng, old, new, {1}, 0)  # layers 0-1 died with device 0
    new2 = ParallelPlan(num_layers=4, layer_ranges=((0, 2), (2, 4)), tp_groups=(((1,), (0,)),), num_microbatches=2)
    trs = transfer_plan(eng, old, new2, {0, 1}, 0)
    emb = {t.dst: t.src for t in trs if t.name == "model.embed_tokens.weight"}
    # stages swapped devices: each needs the tied weight and each already holds a copy
    assert emb == {0: 0, 1: 1}


def test_what_cannot_be_carried_is_refused_up_front():
    import transformers

    ds = TextWindows(TEXT, 16)
    with pytest.raises(ValueError, match="active dropout"):
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1)
        user_job(transformers.LlamaForCausalLM(cfg), optimizer=adamw, dataset=ds)
    model = tiny_model("llama")
    opt = adamw(list(model.parameters()))
    with pytest.raises(TypeError, match="not an instance"):
        user_job(model, optimizer=adamw, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                 dataset=ds)
    with torch.device("meta"):  # accepted now: materialised per stage (test_torch_native_meta.py)
        meta = tiny_model("llama")
    assert UserStages(meta).meta
    with pytest.raises(TypeError, match="map-style"):
        user_job(model, optimizer=adamw, dataset=iter([1, 2])).data(4)
    with pytest.raises(TypeError, match="not a decoder-only causal LM"):
        UserStages(torch.nn.Linear(2, 2))
    # an optimizer instance is rebuilt from its class and defaults
    built = user_job(model, optimizer=opt, dataset=ds).recipe.optimizer([torch.nn.Parameter(torch.zeros(2))])
    assert type(built) is type(opt) and built.defaults == opt.defaults
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    again = user_job(model, optimizer=sgd, dataset=ds).recipe.optimizer([torch.nn.Parameter(torch.zeros(2))])
    assert type(again) is torch.optim.SGD and again.defaults == sgd.defaults


def test_the_lr_schedule_is_rebuilt_at_the_committed_iteration_from_the_factorys_lr():
    """However the optimizer's groups were left (a restored checkpoint's or a rolled-back
    step's scheduled lr), the rebuilt scheduler is where the fault-free run's is."""
    from hf_model import warmup_cosine

    from resihp_adapters.torch_native.engine import TorchNativeEngine

    user = user_job(tiny_model("llama"), optimizer=adamw, lr_scheduler=warmup_cosine(8), dataset=TextWindows(TEXT, 16))
    params = [torch.nn.Parameter(torch.zeros(2))]
    ref_opt = adamw(params)
    ref = warmup_cosine(8)(ref_opt)
    for _ in range(5):
        ref_opt.step()
        ref.step()
    eng = TorchNativeEngine(0, user.stages, None, None, recipe=user.recipe)
    eng.optimizer = adamw(params)
    eng._base_groups = [{k: v for k, v in g.items() if k != "params"} for g in eng.optimizer.param_groups]
    eng.optimizer.param_groups[0]["lr"] = 123.0  # what a loaded state dict may leave
    eng.iteration = 5
    eng._make_scheduler()
    assert eng.optimizer.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert eng.scheduler.state_dict()["last_epoch"] == ref.state_dict()["last_epoch"] == 5


def test_any_model_through_the_split_protocol():
    """A plain module (not HF) described by a Split: stages under its own names, chained
    equal to its own forward; (input, target) samples; a mean loss is divided by G."""
    from resihp_adapters.torch_native.split import Split

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Linear(3, 4)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
            self.head = torch.nn.Linear(4, 2)

        def forward(self, x):
            h = self.emb(x)
            for b in self.blocks:
                h = torch.relu(b(h))
            return self.head(h)

    split = Split(pre=("emb",), blocks=("blocks.0", "blocks.1", "blocks.2"), post=("head",),
                  embed=lambda st, x, kw: st.part("emb")(x), block=lambda m, h, ctx: torch.relu(m(h)),
                  head=lambda st, h: st.part("head")(h))
    net = Net()
    ds = [(torch.randn(3), torch.tensor(i % 2)) for i in range(8)]
    user = user_job(net, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                    loss_fn=torch.nn.functional.cross_entropy, dataset=ds, split=split, micro_batch_size=2)
    a, b = user.stages.build(0, 1), user.stages.build(1, 3)
    assert [n for n, _ in b.named_parameters()] == ["blocks.1.weight", "blocks.1.bias", "blocks.2.weight",
                                                    "blocks.2.bias", "head.weight", "head.bias"]
    mb = user.data(4).micro_batch(0, 1, 1, 2)  # global micro-batch 3: samples 6, 7
    assert torch.equal(mb.args[0], torch.stack([ds[6][0], ds[7][0]])) and mb.target.tolist() == [0, 1]
    assert torch.equal(b(a(mb.args[0])), net(mb.args[0]))
    assert user.data(4).denominator(0) == 4.0
    with pytest.raises(ValueError, match="in no pre / block / post module"):
        UserStages(net, Split(pre=("emb",), blocks=("blocks.0",), post=("head",), embed=split.embed,
                              block=split.block, head=split.head))


def test_your_loop_refuses_a_pipelined_job_and_mixing_with_train_batch():
    """trainer.iterations() (the user's loop, docs/torch_native.md "Your loop") runs
    data-parallel jobs only: the first plan is read before any generation is entered
    and a pipelined one is refused with the reason; one job trains one way."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from resihp_core.protocol import PlanUpdate
    from resihp_core.runtime import session
    from resihp_adapters.torch_native.api import ResilientTrainer

    def trainer(pp: int) -> ResilientTrainer:
        store = dist.HashStore()
        plan = ParallelPlan.uniform(tp=1, pp=pp, dp=4 // pp, num_layers=4, num_microbatches=2)
        session.post_plan(store, PlanUpdate(generation=0, plan=plan.to_text(), devices=(0, 1, 2, 3), iterations=3))
        engine = SimpleNamespace(cfg=None, whole=False)
        return ResilientTrainer(SimpleNamespace(store=store, adapter=SimpleNamespace(engine=engine),
                                                step=lambda: None))

    t = trainer(pp=2)
    with pytest.raises(ValueError, match=r"pp = 2.*train_batch\(\)"):
        t.iterations()
    assert t.worker.adapter.engine.whole is False  # the engine still builds pipeline stages
    t = trainer(pp=1)
    assert t.train_batch() is None
    with pytest.raises(RuntimeError, match="cannot be mixed"):
        t.iterations()


def test_the_fault_free_reference_of_a_job_with_the_users_model_is_that_models():
    """``reference_losses`` (what ``resihp run`` and gpu_check compare a run with) trains
    the model ``adapter_config.user`` names, not the adapter's own LLaMA."""
    from resihp_core.job import JobSpec
    from resihp_adapters.torch_native.adapter import load_user
    from resihp_adapters.torch_native.reference import reference_losses, user_single_process_run

    spec = JobSpec(adapter="torch_native", adapter_config={"user": "hf_model:user_llama"},
                   data={"source": "synthetic", "token_budget": 16}, dp=2, num_microbatches=2, seed=5)
    user = load_user("hf_model:user_llama")
    want = user_single_process_run(user.stages, user.recipe, user.data(4), 2)[1]
    assert reference_losses(spec, 2) == want
    own = JobSpec(adapter="torch_native", data={"source": "synthetic", "token_budget": 16}, dp=2,
                  num_microbatches=2, seed=5)
    assert reference_losses(own, 2) != want
