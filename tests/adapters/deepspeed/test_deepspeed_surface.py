"""The handle ``initialize`` returns answers every public name of the installed
DeepSpeed's ``PipelineEngine``: implemented by the handle, read from the current plan
generation's engine, or refused with a message naming the call and the reason."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from types import SimpleNamespace

import pytest

pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

from resihp_adapters.deepspeed.api import ResilientEngine, StockEngine  # noqa: E402
from resihp_adapters.deepspeed.surface import DELEGATED, OWN, REFUSED, EngineCallRefused  # noqa: E402

pytestmark = [pytest.mark.deepspeed]


def deepspeed_public_api() -> set[str]:
    """Public names of DeepSpeed's ``PipelineEngine``: those of the class (its methods
    and ``nn.Module``'s) and every ``self.<name> = ...`` in DeepSpeed's engine classes."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    names = {n for n in dir(PipelineEngine) if not n.startswith("_")}
    for cls in PipelineEngine.__mro__:
        if not cls.__module__.startswith("deepspeed"):
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
                    and node.value.id == "self" and not node.attr.startswith("_")):
                names.add(node.attr)
            # DeepSpeed registers ``module`` through ``self.__dict__['module'] = model``.
            if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__"
                    and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)
                    and not node.slice.value.startswith("_")):
                names.add(node.slice.value)
    return names


def test_every_public_name_of_deepspeeds_pipeline_engine_is_implemented_delegated_or_refused():
    api = deepspeed_public_api()
    assert len(api) > 300  # the introspection found DeepSpeed's engine, not an empty class
    unanswered = sorted(api - OWN - DELEGATED - set(REFUSED))
    assert not unanswered, f"PipelineEngine names ResiHP's engine neither implements nor refuses: {unanswered}"
    assert not (OWN & DELEGATED) and not (OWN & set(REFUSED)) and not (DELEGATED & set(REFUSED))
    # Every name the handle implements is on the handle itself, not left to __getattr__.
    assert [n for n in OWN if n not in vars(ResilientEngine)] == []
    # No stale entries: every listed name is DeepSpeed's (nn.Module's ``training`` aside).
    assert sorted((OWN | DELEGATED | set(REFUSED)) - api - {"training"}) == []


class _Worker:
    """The parts of ``Worker`` the handle reads; ``engine`` is the generation's engine."""

    def __init__(self, engine: object) -> None:
        self.iteration, self.device = 3, 1
        self.job = SimpleNamespace(num_microbatches=4, dp=2)
        self.adapter = SimpleNamespace(engine=engine, plan=None, where=None, ctx=SimpleNamespace(device=1),
                                       close=lambda: None, _held={}, idle_global=None)

    def next_iteration(self) -> int:
        return self.iteration


def _handle(engine: object) -> ResilientEngine:
    return ResilientEngine(_Worker(engine), SimpleNamespace(micro_batch_size=5, dataset=[1, 2], collate_fn=None))


def test_delegated_names_read_the_current_generations_engine_and_own_ones_are_the_jobs():
    gen = SimpleNamespace(stage_id=1, optimizer="opt", get_lr=lambda: [0.5], module="mod", global_steps=0)
    h = _handle(gen)
    assert (h.stage_id, h.optimizer, h.get_lr()[0], h.module) == (1, "opt", 0.5, "mod")
    gen.stage_id = 0  # a reconfiguration: the next read sees the new generation's engine
    h.worker.adapter.engine = SimpleNamespace(**{**vars(gen), "stage_id": 0})
    assert h.stage_id == 0
    # The job's counters and batch, not the generation engine's.
    assert (h.global_steps, h.train_batch_size(), h.gradient_accumulation_steps(), h.micro_batches) == (3, 40, 4, 4)
    assert h.global_samples == 120 and h.training_data == [1, 2]


def test_refused_calls_and_assignments_name_the_call_and_the_reason():
    h = _handle(SimpleNamespace(stage_id=0))
    for call, name in ((lambda: h.forward(torch.zeros(1)), "forward"), (lambda: h.to("cpu"), "to"),
                       (lambda: h.set_dataiterator(iter([])), "set_dataiterator"),
                       (lambda: h.training_dataloader, "training_dataloader"),
                       (lambda: h.train_batch(iter([])), "train_batch(data_iter)"),
                       (lambda: h.load_module_state_dict({}), "load_module_state_dict")):
        with pytest.raises(EngineCallRefused, match=rf"engine\.{re.escape(name)}[ :=].*not available under resihp launch"):
            call()
    assert callable(h.backward)  # a method stays a method (hasattr answers), refused when called
    with pytest.raises(EngineCallRefused, match=r"engine\.optimizer = \.\.\..*lost"):
        h.optimizer = object()
    h.my_note = 1  # names that are not DeepSpeed's stay the user's
    assert h.my_note == 1
    with pytest.raises(AttributeError, match="no_such_thing"):
        h.no_such_thing


def test_a_rank_without_an_engine_says_why_naming_the_call():
    h = _handle(None)
    with pytest.raises(RuntimeError, match=r"engine\.get_lr: device 1 runs no DeepSpeed engine now: .*standby"):
        h.get_lr()
    assert h.is_last_stage() is False


def test_the_stock_handle_is_deepspeeds_engine_for_every_other_name():
    ds = SimpleNamespace(stage_id=1, grid=SimpleNamespace(data_parallel_id=0), eval_return_logits=False)
    s = StockEngine(ds, SimpleNamespace(iterator=lambda dp_id: iter(())))
    assert s.current is ds and s.stage_id == 1 and s.grid is ds.grid
    s.eval_return_logits = True  # DeepSpeed's engine is the one that reads it
    assert ds.eval_return_logits is True


def test_train_batch_takes_a_deepspeed_io_loader_of_the_training_data_and_reads_its_order():
    """``train_batch(RepeatingLoader(engine.deepspeed_io(training_data)))``: the job reads
    micro-batches by address in that loader's order (DeepSpeed's shuffling sampler, seed
    0) from its first step; another iterator, another dataset or mixing is refused."""
    from deepspeed.utils import RepeatingLoader

    from resihp_adapters.deepspeed.data import MicroBatchSource

    data = [(torch.tensor([float(i)]), torch.tensor([0.0])) for i in range(16)]
    src = MicroBatchSource(data, MicroBatchSource.default_collate, 2, 4, 2, shuffle=False)
    h = _handle(None)
    h.spec.dataset, h.spec.micro_batch_size, h.worker.adapter.source = data, 2, src
    with pytest.raises(EngineCallRefused, match=r"its dataset is not the one given to initialize"):
        h._data_order(RepeatingLoader(h.deepspeed_io(list(data))))
    with pytest.raises(EngineCallRefused, match=r"its own data_sampler"):
        h._data_order(h.deepspeed_io(data, data_sampler=object()))
    with pytest.raises(EngineCallRefused, match=r"not a loader of this engine's deepspeed_io"):
        h._data_order(iter(data))
    h._data_order(RepeatingLoader(h.deepspeed_io(data)))  # RepeatingLoader iterates lazily: no engine needed yet
    got = h.worker.adapter.source
    want = MicroBatchSource(data, src.collate_fn, 2, 4, 2, shuffle=True, seed=0)
    assert got.shuffle and [got.indices(1, r, 2) for r in (0, 1)] == [want.indices(1, r, 2) for r in (0, 1)]
    assert [got.indices(1, r, 2) for r in (0, 1)] != [src.indices(1, r, 2) for r in (0, 1)]
    with pytest.raises(EngineCallRefused, match=r"mixing"):
        h._data_order(None)
