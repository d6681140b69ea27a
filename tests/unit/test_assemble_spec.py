"""assemble_spec: a job written as the workers' JobSpec and a first plan (the conformance
kit, benchmarks) goes through the same assemble() as ``resihp run``; no process starts."""

from __future__ import annotations

import pytest

from resihp_core.config import ConfigError
from resihp_core.faults import Fault
from resihp_core.job import JobSpec
from resihp_core.plan import ParallelPlan
from resihp_core.runtime.controller.assemble import assemble_spec


def test_the_adapters_section_data_plan_and_faults_reach_the_workers_as_given(tmp_path):
    base = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=2, num_heads=4)
    section = dict(vocab_size=64, hidden=32, num_heads=4, ffn_hidden=64, num_layers=4, dtype="float64")
    data = dict(source="synthetic", scale=12.0, min_len=2, max_len=64, token_budget=64)
    job = JobSpec(adapter="megatron_ref", adapter_config=section, data=data, dp=2, num_microbatches=2, seed=3,
                  timeout_s=7.0, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2, checkpoint_keep=2,
                  faults=[Fault(device=0, iteration=5, kind="kill").to_dict()])
    asm = assemble_spec(job, base, iterations=6, faults=[Fault(device=3, iteration=2, kind="kill")],
                        workdir=tmp_path, detector={"hang_min_timeout_s": 60.0})
    spec = asm.run.spec
    # The section is the adapter's own (megatron_ref's job_config would add seed, lr, backend).
    assert spec.adapter_config == section and spec.data == data
    assert (spec.seed, spec.timeout_s, spec.checkpoint_every, spec.checkpoint_keep) == (3, 7.0, 2, 2)
    assert spec.checkpoint_dir == str(tmp_path / "ck")
    assert [(f["device"], f["iteration"]) for f in spec.faults] == [(0, 5), (3, 2)]
    assert asm.run.plan == base and asm.run.state.plan == base and asm.run.iterations == 6
    assert asm.run.detector.hang_min_timeout_s == 60.0 and asm.run.controller_grace_s == 0.0
    assert asm.reference is not None  # a registered adapter keeps its reference


def test_an_unregistered_adapter_class_is_assembled_by_its_target(tmp_path):
    base = ParallelPlan.uniform(tp=1, pp=1, dp=2, num_layers=1, num_microbatches=2)
    job = JobSpec(adapter="resihp_adapters.megatron_ref.adapter:MegatronRefAdapter", adapter_config={"x": 1},
                  dp=2, num_microbatches=2)
    asm = assemble_spec(job, base, iterations=2, workdir=tmp_path)
    assert asm.spec.adapter == job.adapter and asm.spec.adapter_config == {"x": 1} and asm.reference is None
    with pytest.raises(ConfigError, match="runtime.adapter.*cannot load"):
        assemble_spec(JobSpec(adapter="no_such_module:Adapter", dp=2, num_microbatches=2), base, iterations=2,
                      workdir=tmp_path)
    with pytest.raises(ConfigError, match=r"dp 2 x 4 micro-batches\) is not the first plan's \(2 x 2\)"):
        assemble_spec(JobSpec(adapter="megatron_ref", dp=2, num_microbatches=4), base, iterations=2, workdir=tmp_path)
