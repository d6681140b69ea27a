"""The vectorised predictor agrees with the plain per-chunk cost definition."""

from __future__ import annotations

import numpy as np
import pytest

from resihp_core.plan import Migration, ParallelPlan, Topology
from resihp_core.predictor.corpus import CorpusSpec, iteration_workload
from resihp_core.predictor.cost import CostModel, LinkModel, StageCost, vertex_times
from resihp_core.predictor.predict import IterationPredictor, ModelShape

FREE = LinkModel(intra_bandwidth=1e30, inter_bandwidth=1e30, intra_latency=0.0, inter_latency=0.0)


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_durations_equal_vertex_times_on_a_heterogeneous_plan(schedule):
    base = ParallelPlan.uniform(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=3, schedule=schedule)
    plan = base.with_(
        layer_ranges=((0, 1), (1, 4)),
        tp_groups=(base.tp_groups[0], (base.tp_groups[1][0], (6,))),
        migrations=(Migration(stage=1, replica=1, mb=1, to=0), Migration(stage=0, replica=0, mb=2, to=1)),
    )
    work = iteration_workload(CorpusSpec(token_budget=64, scale=16), 0, 2, 3)
    cost = CostModel((StageCost(1.0, 0.01, 2.0, 0.02, ref_layers=1, ref_tp=1, w_fraction=0.4),
                      StageCost(1.5, 0.02, 2.5, 0.03, ref_layers=3, ref_tp=2, w_fraction=0.4)))
    speeds = {4: 0.5, 6: 0.8, 1: 0.9}
    pred = IterationPredictor(cost, Topology.uniform(1, 8), ModelShape(tokens=64, hidden=8, params_per_layer=1), FREE)
    dur = pred.inputs(plan, work, speeds)["durations"]
    ref = vertex_times(plan, work, cost, speeds)
    kinds = "FBW"
    for (kind, _executor, stage, owner, mb), t in ref.items():
        assert dur[kinds.index(kind), stage, owner, mb] == pytest.approx(t, rel=1e-12)
    assert np.count_nonzero(dur) == len(ref)
