"""``resihp launch --config_file accelerate.yaml train.py [args]``: an ``accelerate
launch`` that survives dead and slow devices.

The accelerate config is read with accelerate's own launch-argument code (so defaults
and validation are accelerate's), the DeepSpeed JSON it points to
(``deepspeed_config_file``) supplies the batch settings and ResiHP's ``resihp``
section, and the job runs as any ResiHP job: a controller here, one agent per node,
each worker started with the environment ``accelerate launch`` computes for its
workers (``prepare_deepspeed_cmd_env``) plus torchrun's per-process variables. Unlike
torchrun's elastic agent, an agent does not stop a worker's siblings when it dies: the
Scheduler re-plans and the survivors go on in their processes.

``resihp`` section of the DeepSpeed JSON (``docs/deepspeed.md``): ``num_layers``
(required: the plan cuts layers), ``iterations`` (required), ``pp`` (default 2),
``nodes`` (1), ``timeout_s`` (10), ``checkpoint_every`` (1), ``faults`` (injected
faults, for demos and tests: ``[{"device", "iteration", "kind", ...}]``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from resihp_core.adapter import Capabilities
    from resihp_core.runtime.controller.assemble import AssembledJob

__all__ = ["configure", "run", "run_demo", "accelerate_env", "read_resihp_section"]


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config_file", required=True, help="accelerate config (YAML) naming a deepspeed_config_file")
    p.add_argument("--workdir", help="folder for logs and checkpoints (default: a fresh temporary folder)")
    p.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds (default 900)")
    p.add_argument("training_script", help="the training script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER, help="its arguments")


def accelerate_env(config_file: str, script: str, script_args: list[str]) -> tuple[Any, dict[str, str]]:
    """accelerate's parsed launch arguments and the environment it gives workers."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    a = launch_command_parser().parse_args(["--config_file", config_file, script, *script_args])
    a, defaults, mp_from_config = _validate_launch_command(a)
    if not a.use_deepspeed:
        raise ValueError(f"{config_file}: distributed_type must be DEEPSPEED for 'resihp launch'")
    if not a.deepspeed_config_file:
        raise ValueError(f"{config_file}: deepspeed_config.deepspeed_config_file is not set (ResiHP reads its "
                         "'resihp' section from that JSON)")
    fields = list(defaults.deepspeed_config.keys()) if defaults else []
    if mp_from_config:
        fields.append("mixed_precision")
    a.deepspeed_fields_from_accelerate_config = ",".join(fields)
    base = os.path.dirname(os.path.abspath(config_file))
    if not os.path.isabs(a.deepspeed_config_file):
        cand = os.path.join(base, a.deepspeed_config_file)
        a.deepspeed_config_file = cand if os.path.exists(cand) else os.path.abspath(a.deepspeed_config_file)
    _, env = prepare_deepspeed_cmd_env(a)
    return a, dict(env)


#: Every key of the DeepSpeed JSON's ``resihp`` section (docs/deepspeed.md).
RESIHP_KEYS = ("num_layers", "iterations", "pp", "nodes", "checkpoint_every", "timeout_s", "backend", "faults",
               "detector")


def read_resihp_section(ds_config: dict[str, Any], path: str) -> dict[str, Any]:
    """The ``resihp`` section, its required keys checked; an unknown key (a misspelled
    optional one would be ignored silently) is refused with the closest valid name."""
    import difflib

    sec = ds_config.get("resihp")
    if not isinstance(sec, dict):
        raise ValueError(f"{path}: no 'resihp' section (an object) in the DeepSpeed config")
    for key in sec:
        if key not in RESIHP_KEYS:
            close = difflib.get_close_matches(str(key), RESIHP_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (valid keys: {', '.join(RESIHP_KEYS)})"
            raise ValueError(f"{path}: resihp.{key}: unknown key{hint}")
    for key in ("num_layers", "iterations"):
        v = sec.get(key)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{path}: resihp.{key} must be an integer >= 1, got {v!r}")
    return sec


def check_zero_checkpoints(ds_config: dict[str, Any], sec: dict[str, Any], path: str) -> None:
    """ZeRO 1 without ResiHP checkpoints cannot survive a kill: each stage's optimizer
    state is partitioned over its replicas, a killed rank takes the only copy of its
    shard along, and the survivors restore from the newest checkpoint (docs/deepspeed.md,
    ZeRO). Refused up front rather than failing at the first kill."""
    zero = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    every = int(sec.get("checkpoint_every", 1))
    if zero >= 1 and every < 1:
        raise ValueError(f"{path}: zero_optimization.stage={zero} with resihp.checkpoint_every={every}: under ZeRO 1 "
                         "a killed rank takes the only copy of its optimizer-state shard, which ResiHP restores "
                         "from its newest checkpoint; set resihp.checkpoint_every >= 1 (or use ZeRO stage 0)")


#: The script's ``partition_method`` is an expression the launcher cannot read.
UNREAD = "<expression>"


def check_script_calls_initialize(script: str) -> str:
    """Refuse a script that never calls ``initialize`` (ResiHP's; ``deepspeed.initialize``
    does not count): under ``resihp launch`` its workers would train nothing the runtime
    can see, and their exit would read as failed devices. Returns the call's
    ``partition_method`` ("uniform" when not given, :data:`UNREAD` when not a literal)."""
    import ast

    try:
        tree = ast.parse(Path(script).read_text(), filename=script)
    except (OSError, SyntaxError) as e:
        raise ValueError(f"{script}: cannot read the training script ({e})") from None
    from resihp_adapters.deepspeed.partition import check_partition_method

    found, method = False, "uniform"
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            ours = (isinstance(f, ast.Name) and f.id == "initialize") or (
                isinstance(f, ast.Attribute) and f.attr == "initialize"
                and not (isinstance(f.value, ast.Name) and f.value.id == "deepspeed"))
            if ours:
                found = True
                for kw in node.keywords:  # a literal DeepSpeed would refuse: say so now
                    if kw.arg == "partition_method":
                        method = check_partition_method(kw.value.value) if isinstance(kw.value, ast.Constant) \
                            else UNREAD
                    elif kw.arg is None:  # **kwargs may carry it
                        method = UNREAD
    if found:
        return method
    raise ValueError(f"{script} never calls initialize(): under 'resihp launch' the script must build its engine "
                     "with resihp_adapters.deepspeed.initialize (docs/deepspeed.md)")


#: How long the partition probe (the script run up to ``initialize``) may take.
PROBE_TIMEOUT_S = 300.0


def probe_partition(script: str, script_args: list[str], env: dict[str, str], pp: int,
                    num_layers: int, workdir: Path) -> tuple[tuple[tuple[int, int], ...], str]:
    """DeepSpeed's initial split of the script's layers: the script runs once, as rank 0
    of no world, up to ``initialize``, which writes the split DeepSpeed's
    ``PipelineModule`` computes for its ``partition_method`` and exits (:mod:`.partition`).
    Returns the split as a plan's layer ranges and the method the script passed.
    Needed because the first plan is made before any worker runs the script."""
    import subprocess

    from resihp_adapters.deepspeed.partition import PROBE_ENV, PROBE_STAGES_ENV, parts_to_ranges, read_probe

    workdir.mkdir(parents=True, exist_ok=True)
    answer, log = workdir / "partition-probe.json", workdir / "partition-probe.log"
    penv = {k: v for k, v in {**os.environ, **env}.items() if not k.startswith("RESIHP_STORE")}
    penv.update({PROBE_ENV: str(answer), PROBE_STAGES_ENV: str(pp), "RANK": "0", "LOCAL_RANK": "0",
                 "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")})
    with open(log, "w") as out:
        # Through the worker module: the script's deepspeed.init_distributed() is deferred
        # there too (this process has no world to join; script_worker.py).
        p = subprocess.Popen([sys.executable, "-m", "resihp_adapters.deepspeed.script_worker", "--probe", script,
                              *script_args], env=penv, stdout=out, stderr=subprocess.STDOUT, cwd=os.getcwd())
        try:
            rc = p.wait(timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise ValueError(f"{script}: the partition probe (the script run up to initialize() to learn DeepSpeed's "
                             f"stage split) did not finish in {PROBE_TIMEOUT_S:.0f} s; see {log}") from None
    if rc != 0 or not answer.exists():
        tail = log.read_text()[-1500:] if log.exists() else ""
        raise ValueError(f"{script}: the partition probe (the script run up to initialize() to learn DeepSpeed's "
                         f"stage split) exited with code {rc} without an answer; its output ends:\n{tail}")
    got = read_probe(str(answer))
    if int(got.get("num_layers", -1)) != num_layers:
        raise ValueError(f"{script} builds {got.get('num_layers')} layers, but resihp.num_layers is {num_layers}")
    return parts_to_ranges(got["parts"]), str(got.get("method"))


def assemble_launch(num_processes: int, ds_config: dict[str, Any], sec: dict[str, Any], workdir: Path,
                    layer_ranges: tuple[tuple[int, int], ...] | None = None) -> AssembledJob:
    """The launch's job, assembled as every job is (:func:`~resihp_core.runtime.controller.assemble.assemble`):
    the DeepSpeed JSON and its ``resihp`` section read as a ResiHP configuration, the
    JSON's op timeout, the script's own data and its initial stage split
    (``layer_ranges``; None: the uniform one) as :class:`JobInputs`."""
    from resihp_core.config import Config
    from resihp_core.faults import load_scenario
    from resihp_core.predictor.corpus import CorpusSpec, iteration_workload
    from resihp_core.predictor.predict import ModelShape
    from resihp_core.runtime.controller.assemble import JobInputs, UserData, assemble

    from resihp_adapters.deepspeed.plugin import capabilities_for

    pp, nodes = int(sec.get("pp", 2)), int(sec.get("nodes", 1))
    if num_processes % pp or num_processes % nodes:
        raise ValueError(f"num_processes={num_processes} must be a multiple of resihp.pp={pp} and resihp.nodes={nodes}")
    dp, m, per_node = num_processes // pp, int(ds_config.get("gradient_accumulation_steps", 1)), num_processes // nodes
    # A worker's first engine build (DeepSpeed import, JIT-free) can hold the GIL for
    # seconds on a loaded machine: tolerate missed heartbeats longer than the core's default.
    # The controller counts an agent silent for 2 x this many heartbeats as a lost node
    # (a dead agent is seen at once: its connection closes); 50 (10 s) lost every node of
    # four launches starting 16 DeepSpeed workers at once on 2 cores at load 66.
    detector = {"heartbeat_miss_limit": 150, "hang_min_timeout_s": 30.0, **(sec.get("detector") or {})}
    cfg = Config.from_dict({
        "parallel": {"tp": 1, "pp": pp, "dp": dp},
        # No controller failover here: the launch's controller is its agents' parent.
        "runtime": {"adapter": "deepspeed", "nodes": nodes, "devices_per_node": per_node, "controller_grace_s": 0.0},
        "model": {"layers": int(sec["num_layers"])},
        "training": {"microbatches": m, "iterations": int(sec["iterations"]),
                     "checkpoint_every": int(sec.get("checkpoint_every", 1)), "checkpoint_keep": 0},
        "detector": detector,
        # The DeepSpeed adapter's section: where its workers bind their collectives.
        "adapter": {"backend": str(sec.get("backend", "auto")), "devices_per_node": per_node},
    }, source="resihp section of the DeepSpeed config")
    # Planning prior for the script's own data and model (the Detector fits its own).
    corpus = CorpusSpec(scale=8.0, shape=1.0, min_len=4, max_len=64, token_budget=64, seed=0)
    user = UserData(workload=iteration_workload(corpus, 0, dp, m),
                    shape=ModelShape(tokens=64, hidden=64, params_per_layer=64 * 64, dtype_bytes=4))
    inputs = JobInputs(op_timeout_s=float(sec.get("timeout_s", 10.0)), user_data=user, layer_ranges=layer_ranges)
    job = assemble(cfg, load_scenario(sec.get("faults", [])), workdir, inputs)
    return with_capabilities(job, capabilities_for(ds_config))


def with_capabilities(job: AssembledJob, caps: Capabilities) -> AssembledJob:
    """``job`` with the Scheduler told ``caps`` (what this configuration runs, which the
    registered adapter's capabilities cannot know: :func:`~.plugin.capabilities_for`)."""
    import dataclasses

    from resihp_core.scheduler import Planner

    if caps == job.state.capabilities:
        return job
    why = caps.violations(job.plan)
    if why:
        raise ValueError(f"the DeepSpeed configuration cannot run the first plan: {'; '.join(why)}")
    state = dataclasses.replace(job.state, capabilities=caps)
    planner = Planner(capabilities=caps)
    return job._replace(state=state, planner=planner, run=dataclasses.replace(job.run, state=state, planner=planner))


#: How long ``resihp launch`` waits for the node agents it starts to connect.
AGENT_CONNECT_S = 300.0


def run(args: argparse.Namespace) -> int:
    """``resihp launch``: returns 0 when every iteration committed."""
    import dataclasses

    from resihp_core.cli import CliError
    from resihp_core.runtime.controller.console import RunLog, finish
    from resihp_core.runtime.controller.resilient import RunHooks, run_resilient

    from resihp_adapters.deepspeed.spec import check_supported, load_ds_config

    script = os.path.abspath(args.training_script)
    script_args = [a for a in args.training_script_args if a != "--"] if args.training_script_args else []
    try:
        a, env = accelerate_env(args.config_file, script, script_args)
        ds = load_ds_config(a.deepspeed_config_file)
        sec = read_resihp_section(ds, a.deepspeed_config_file)
        # Configuration errors stop here, with the reason, before any worker starts (a
        # worker that refused its config would otherwise look like a failed device).
        check_supported(ds)
        check_zero_checkpoints(ds, sec, a.deepspeed_config_file)
        method = check_script_calls_initialize(script)
        work = Path(args.workdir or tempfile.mkdtemp(prefix="resihp-launch-"))
        ranges = None
        if method != "uniform":  # DeepSpeed's own split of the script's layers (docs/deepspeed.md)
            penv = {**env, "ACCELERATE_DEEPSPEED_CONFIG_FILE": a.deepspeed_config_file,
                    "WORLD_SIZE": str(a.num_processes)}
            ranges, method = probe_partition(script, script_args, penv, int(sec.get("pp", 2)),
                                             int(sec["num_layers"]), work)
        job = assemble_launch(int(a.num_processes), ds, sec, work, ranges)
    except (ValueError, OSError) as e:  # ConfigError and FaultError are ValueErrors
        raise CliError(str(e)) from e
    per_node = int(a.num_processes) // int(sec.get("nodes", 1))
    env.update(RESIHP_LAUNCH_SCRIPT=script, RESIHP_LAUNCH_ARGS=json.dumps(script_args),
               WORLD_SIZE=str(a.num_processes), LOCAL_WORLD_SIZE=str(per_node),
               MASTER_ADDR=str(a.main_process_ip or "127.0.0.1"), MASTER_PORT=str(a.main_process_port or 29500),
               ACCELERATE_DEEPSPEED_CONFIG_FILE=a.deepspeed_config_file, OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    os.environ.update(env)  # agents start here and pass their environment on to workers
    plan = job.plan
    split = " ".join(f"{x}-{y}" for x, y in plan.layer_ranges)
    log = RunLog(work)
    log.say(f"resihp launch: {a.num_processes} workers of {script} (PP{plan.pp} x DP{plan.dp}, stages {split}: "
            f"partition_method {method}), {sec['iterations']} iterations; run log {log.path}; "
            f"worker logs in {work / 'job'}")

    from resihp_core.faults import load_scenario
    from resihp_core.runtime.controller.jobs import phases

    faults = load_scenario(sec.get("faults", []))
    phase_of = phases(faults)

    from resihp_core.runtime.controller.console import console_observer

    observe = console_observer(log, phase_of.event)  # a detected failure starts a report phase too

    out = run_resilient(dataclasses.replace(
        job.run, worker_module="resihp_adapters.deepspeed.script_worker", timeout_s=args.timeout,
        # Its own agents, started here: on a loaded machine one took over the
        # core's 60 s to import and connect (a dead one is seen when it exits).
        agents=dataclasses.replace(job.run.agents, timeout_s=AGENT_CONNECT_S),
        hooks=RunHooks(observe=observe, phase_of=phase_of)))
    report = getattr(args, "report", None)
    if report and out.records:
        write_launch_report(Path(report), out, faults, f"resihp demo --adapter deepspeed: PP{plan.pp} x DP{plan.dp}")
    return finish(out, log, what="resihp launch", iterations=int(sec["iterations"]))


def write_launch_report(parent: Path, out: Any, faults: list[Any], title: str) -> Path:
    """The report ``resihp demo`` writes (``report.write_report``: events JSON, loss,
    iteration time and throughput plots, a summary) for a launch's run, in a new folder
    under ``parent``; prints the summary table and the paths. No fault-free reference:
    the script's losses are its own (the launch test compares them with plain DeepSpeed's)."""
    import time

    from resihp_core.report import format_table, summary_table, write_report

    outdir = parent / f"demo-deepspeed-{time.strftime('%Y%m%d-%H%M%S')}"
    records = out.records
    # Iteration 0 carries process start-up (imports, rendezvous, the partition probe): an
    # event, not a point of the iteration-time trace (as the default demo).
    iterations = [dict(iteration=r.iteration, loss=r.loss, seconds=r.seconds, samples=r.samples,
                       generation=r.generation, phase=r.phase) for r in records[1:]] or \
        [dict(iteration=r.iteration, loss=r.loss, seconds=r.seconds, samples=r.samples, generation=r.generation,
              phase=r.phase) for r in records]
    from resihp_core.runtime.controller.jobs import report_events

    paths = write_report(outdir, iterations=iterations, events=report_events(out, faults), title=title)
    print()
    print(format_table(summary_table(iterations)))
    print(f"\nreport: {outdir}")
    for name, path in paths.items():
        print(f"  {name}: {path}")
    return outdir


def run_demo(args: argparse.Namespace) -> int:
    """``resihp demo --adapter deepspeed``: the DeepSpeed example under ``resihp launch``
    (PP2 x DP2, 4 CPU workers) with device 3 SIGKILLed at ``--kill-at``."""
    import shutil

    example = Path(__file__).resolve().parents[3] / "examples" / "deepspeed_pipeline"
    if not example.is_dir():
        raise SystemExit(f"the DeepSpeed example is not in this installation ({example})")
    work = Path(tempfile.mkdtemp(prefix="resihp-demo-deepspeed-"))
    for f in ("accelerate.yaml", "train.py"):
        shutil.copy(example / f, work / f)
    cfg = json.loads((example / "ds_config.json").read_text())
    iterations = min(int(args.iterations), 200)
    kill_at = min(int(args.kill_at), iterations - 1)
    cfg["resihp"].update(iterations=iterations, faults=[{"device": 3, "iteration": kill_at, "kind": "kill"}])
    (work / "ds_config.json").write_text(json.dumps(cfg, indent=2))
    print(f"resihp demo --adapter deepspeed: {work}/train.py, device 3 killed at iteration {kill_at}", flush=True)
    cwd = os.getcwd()
    os.chdir(work)
    try:
        ns = argparse.Namespace(config_file="accelerate.yaml", workdir=str(work / "run"), timeout=900.0,
                                training_script="train.py", training_script_args=["--iterations", str(iterations)],
                                report=os.path.join(cwd, args.report) if getattr(args, "report", None) else None)
        return run(ns)
    finally:
        os.chdir(cwd)
