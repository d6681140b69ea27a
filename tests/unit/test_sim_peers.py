"""The simulator's peers (torchft, checkpoint-restart): their accounting by hand, the
Young/Daly interval, and `resihp simulate` with them; and the pure parts of
benchmarks/peers.py (traces, Young/Daly in iterations, goodput arithmetic)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from resihp_core.cli import main
from resihp_core.sim.cluster import Costs, JobSpec
from resihp_core.sim.engine import run
from resihp_core.sim.policies import PeerCalibration, young_daly_interval
from resihp_core.sim.report import policy
from resihp_core.sim.trace import FailureEvent, Trace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import peers  # noqa: E402

JOB = JobSpec()  # LLaMA-2 7B, tp4 pp2 dp2: two replica groups of 8 devices


@pytest.fixture(scope="module")
def state0():
    return JOB.state()


def test_young_daly() -> None:
    assert young_daly_interval(2.0, 3600.0) == pytest.approx(120.0)
    assert young_daly_interval(0.0, 3600.0) == 0.0
    with pytest.raises(ValueError):
        young_daly_interval(1.0, 0.0)


def test_torchft_drops_the_replica_group_then_heals_it(state0) -> None:
    """A stop takes one of two replica groups out: the survivors pause for the
    heartbeat timeout, then train half the batch per step (no re-spreading) until the
    repaired group restarts and heals from a peer; nothing since a checkpoint is lost."""
    cal = PeerCalibration(torchft_quorum_s=0.0, torchft_pause_s=5.0)
    costs = Costs(heartbeat_detect_s=1.0, restart_s=100.0)
    tr = Trace(JOB, 4000.0, (FailureEvent(1000.0, "stop", 9), FailureEvent(2000.0, "repair", 9)))
    pol = policy("torchft", calibration=cal)
    r = run(tr, pol, costs=costs, state0=state0)
    t0 = state0.evaluator.time(state0.plan)
    heal_s = JOB.state_bytes_per_layer() * state0.plan.num_layers / (JOB.tp * JOB.pp) / costs.state_bandwidth
    # full speed, stalled from the stop to the notice + pause, half speed until the heal
    # (repair + restart), stalled for the transfer, full speed again.
    half_from = 1001.0 + 4.0
    healed = 2000.0 + 100.0
    expected_iters = (1000.0 / t0 + (healed - half_from) / (2 * t0) + (4000.0 - healed - heal_s) / t0)
    # The interrupted iteration at the stop is lost (rounded down).
    assert r.samples / JOB.global_batch == pytest.approx(expected_iters, abs=1.01)
    assert not any(l.get("rollback") == "checkpoint" for l in r.log)
    assert r.segments[-1].throughput == pytest.approx(r.healthy_throughput, rel=1e-9)
    assert any("left the quorum" in l.get("note", "") for l in r.log)


def test_torchft_pays_its_quorum_every_step(state0) -> None:
    tr = Trace(JOB, 3600.0, (), scenario="none")
    t0 = state0.evaluator.time(state0.plan)
    r = run(tr, policy("torchft", calibration=PeerCalibration(torchft_quorum_s=0.5)), state0=state0)
    assert r.retained == pytest.approx(t0 / (t0 + 0.5), rel=1e-6)


def test_checkpoint_restart_uses_young_daly_and_pays_every_write(state0) -> None:
    """The interval is sqrt(2 C MTBF) for the trace's MTBF; a stop loses the work since
    the newest checkpoint (at most one interval) and pays the restart."""
    cal = PeerCalibration(checkpoint_write_bandwidth=1e9)
    tr = Trace(JOB, 7200.0, (FailureEvent(3000.0, "stop", 3),))
    pol = policy("checkpoint-restart", calibration=cal)
    pol.start(_ctx(state0))
    ctx = _ctx(state0)
    ctx.mtbf_s = 7200.0
    c = pol.write_seconds(ctx)
    shard = JOB.state_bytes_per_layer() * state0.plan.layers(0) / JOB.tp
    assert c == pytest.approx(shard / 1e9)
    interval = pol.checkpoint_interval(ctx)
    assert interval == pytest.approx(math.sqrt(2 * c * 7200.0))
    r = run(tr, pol, state0=state0)
    restart = [l for l in r.log if l.get("rollback") == "checkpoint"]
    assert len(restart) == 1
    # Fault-free it runs slower than the job by C per interval.
    # (with no stop in the trace the job's 30-minute figure stands in for the MTBF)
    free = run(Trace(JOB, 3600.0, ()), policy("checkpoint-restart", calibration=cal), state0=state0)
    assert free.retained == pytest.approx(1.0 / (1.0 + c / math.sqrt(2 * c * 1800.0)), rel=1e-9)
    # Lost work is bounded by one interval: it keeps more than `none` with its 30-minute checkpoints.
    none = run(tr, policy("none"), state0=state0)
    assert r.retained > none.retained


def _ctx(state0):
    from resihp_core.sim.engine import SimContext

    return SimContext(JOB, Costs(), state0)


def test_resihp_keeps_more_than_both_peers_under_stops(state0) -> None:
    tr = Trace(JOB, 7200.0, (FailureEvent(600.0, "stop", 9), FailureEvent(4200.0, "repair", 9)))
    res = run(tr, policy("resihp"), state0=state0)
    for name in ("torchft", "checkpoint-restart"):
        assert res.retained > run(tr, policy(name), state0=state0).retained, name


def test_cli_simulate_with_the_peers(capsys) -> None:
    assert main(["simulate", "stop-1h", "--devices", "16", "--seeds", "1", "--hours", "2", "--no-progress",
                 "--policies", "resihp,torchft,checkpoint-restart"]) == 0
    out = capsys.readouterr().out
    assert "torchft" in out and "checkpoint-restart" in out


# ------------------------------------------------------------------ benchmarks/peers.py
def test_peers_traces_are_seeded_and_well_formed() -> None:
    a = peers.make_trace("kill-every-n", 60, 4, every=15, repair_after=5, seed=1)
    assert a == peers.make_trace("kill-every-n", 60, 4, every=15, repair_after=5, seed=1)
    kills = [e for e in a if e.kind == "kill"]
    assert [e.iteration for e in kills] == [20, 35, 50]
    assert all(e.device != 0 for e in a)
    for k in kills:  # each repaired 5 iterations later (inside the run)
        assert any(e.kind == "repair" and e.device == k.device and e.iteration == k.iteration + 5 for e in a)
    assert peers.make_trace("none", 60, 4) == []
    (s,) = peers.make_trace("slow", 60, 4, slow_factor=2.22)
    assert s.kind == "slow" and s.factor == 2.22 and s.iteration == 20
    assert peers.mtbf_iterations(a, 60) == 20.0
    with pytest.raises(ValueError):
        peers.make_trace("nope", 60, 4)


def test_peers_young_daly_in_iterations() -> None:
    # C = 0.05 s, MTBF = 20 iterations of 0.2 s: sqrt(2 * 0.05 * 4) = 0.632 s = 3.2 iterations.
    assert peers.ckpt_interval(0.05, 4.0, 0.2) == 3
    assert peers.ckpt_interval(0.0, 4.0, 0.2) == 1


def test_peers_state_losing_kills_count_only_kills_that_leave_no_live_copy() -> None:
    """ResiHP's Young/Daly MTBF counts the kills after which some state has no live
    replica (pp2dp2: stage 1 is devices 2 and 3; dp4: four copies of everything)."""
    E, pp2dp2 = peers.Event, peers.JOBS["pp2dp2"]
    assert peers.state_losing_kills([E(5, "kill", 2), E(6, "kill", 3)], pp2dp2) == 1
    assert peers.state_losing_kills([E(5, "kill", 2), E(6, "repair", 2), E(6, "kill", 3)], pp2dp2) == 0
    assert peers.state_losing_kills([E(5, "kill", 1), E(6, "kill", 2)], pp2dp2) == 0
    assert peers.state_losing_kills([E(5, "kill", 1), E(6, "kill", 2), E(7, "kill", 3)], peers.JOBS["dp4"]) == 0
    kev = peers.make_trace("kill-every-n", 30, 4, every=10, repair_after=5)
    assert peers.state_losing_kills(kev, peers.JOBS["tp2pp2"]) == 2  # no replica: every kill


def test_peers_goodput_counts_redone_iterations_once() -> None:
    """A checkpoint-restart run: iterations 0-5 at 1 s each, a kill at the start of 6
    restores from the checkpoint after 4 (iteration 4 and 5 redone) 10 s later."""
    C = peers.Commit
    commits = [C(i, float(i), 8) for i in range(6)]  # 0..5 at t=0..5
    commits += [C(4, 15.0, 8), C(5, 16.0, 8)] + [C(i, 11.0 + i, 8) for i in range(6, 10)]
    trace = [peers.Event(6, "kill", 2)]
    s = peers.summarise(commits, trace, 10, warmup=1)
    assert s["complete"] and s["redone"] == 2 and s["redone_per_failure"] == 2.0
    # samples of iterations 2..9 (8 x 8) over t=1..20
    assert s["goodput"] == pytest.approx(64 / 19.0)
    (k,) = s["kills"]
    assert k["gap_s"] == pytest.approx(10.0) and k["back_s"] == pytest.approx(12.0)
    assert s["iteration_s"] == pytest.approx(1.0)
    # A run that stopped early is not complete.
    assert not peers.summarise(commits[:5], trace, 10, warmup=1)["complete"]


def test_peers_reads_resihps_own_checkpoint_writes_from_the_worker_log(tmp_path, capsys) -> None:
    """ResiHP's Young/Daly C comes from the lines its workers log (the worker's own
    ``_log``, so a change of that format fails here, not silently in the benchmark)."""
    from resihp_core.runtime.worker import _log

    _log("checkpoint_written", 2, iteration=4, bytes=3300000, seconds="0.412")
    _log("iteration_done", 2, iteration=5, seconds="9.9")
    _log("checkpoint_written", 2, iteration=1, bytes=3300000, seconds="0.250")
    (tmp_path / "gen1").mkdir()
    (tmp_path / "gen1" / "worker2.log").write_text(capsys.readouterr().err)
    (tmp_path / "agent0.log").write_text("event=checkpoint_written device=0 iteration=9 seconds=5.0\n")
    assert peers.logged_checkpoint_writes(tmp_path) == [(1, 0.25), (4, 0.412)]


def test_peers_fault_free_iteration_time_counts_the_checkpoint_writes() -> None:
    """Iterations of 1 s with a 2 s write after every 4th: the fault-free iteration time
    is the rate (1.5 s), not the median gap (1 s), which would leave the writes out."""
    t, commits = 0.0, []
    for i in range(13):
        commits.append(peers.Commit(i, t, 4))
        t += 3.0 if (i + 1) % 4 == 0 else 1.0
    s = peers.summarise(commits, [], 13, warmup=0)
    assert s["iteration_s"] == pytest.approx(18.0 / 12)


def test_peers_tp2pp2_runs_the_reference_backend_without_torchft() -> None:
    """The TP2 x PP2 job is the reference backend's (megatron_ref, which rejects
    torch_native's ``shard`` field), on 4 workers; torchft refuses it (no TP, no PP)."""
    from resihp_core.config import Config

    job = peers.JOBS["tp2pp2"]
    assert (job.workers, job.batch, job.layout) == (4, 4, "TP2 x PP2 x DP1")
    cfg = Config.from_dict(peers.resihp_config(job, 12, "/tmp/unused"))
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.runtime.adapter) == (2, 2, 1, "megatron_ref")
    assert cfg.adapter == {}
    assert peers.resihp_config(peers.JOBS["dp4"], 12, "/tmp/unused")["adapter"] == {"shard": 1}
    with pytest.raises(ValueError, match="no tensor parallelism"):
        peers.run_torchft(job, [], 12, Path("/nonexistent"), "", 1.0, 5000)


def test_peers_report_says_where_max_wall_s_cut_a_round() -> None:
    """A round stopped inside by --max-wall-s is named in the report's head."""
    saved = {"command": "python benchmarks/peers.py --jobs dp4 --reps 2 --max-wall-s 10", "date": "d",
             "jobs": {}, "runs": [], "rounds": 1, "loadavg": [1.0, 2.0],
             "cut": "round 2 stopped at --max-wall-s 10 s before trace slow of dp4"}
    md, _ = peers.render(saved)
    assert "1 round(s) of 2 asked (stopped by --max-wall-s); then round 2 stopped at --max-wall-s 10 s " \
           "before trace slow of dp4" in md
