"""CPU seconds per training iteration of each worker process, for any of the systems
the benchmarks run (ResiHP's workers, torchrun's stock or DDP scripts, torchft).

Why: on the shared 2-core host the wall time of one run moves by tens of percent with
the other sessions' load, far more than the few percent a fault-free overhead target
asks about. The CPU a worker spends per iteration moves much less with load (it is the
work done, not the wait for a core), so it is reported next to the wall time.

How: a ``sitecustomize`` on the workers' ``PYTHONPATH`` registers a global optimizer
step hook (``torch.optim.optimizer.register_optimizer_step_post_hook``): every system
steps its optimizer exactly once per iteration, so each step marks an iteration's end.
At each step the worker appends ``wall cpu parent_cpu other_cpu`` to its own file:
its process CPU (all threads: heartbeat, committer, gloo), its parent's (ResiHP's node
agent, torchrun's elastic agent) and, when ``RESIHP_ITERCPU_OTHER`` names a pid (the
benchmark process, where ResiHP's controller runs), that process's CPU. The parent and
the other are read by the first worker only (rank or device 0), so they count once.
"""

from __future__ import annotations

import glob
import os
import statistics
from pathlib import Path

ENV_DIR = "RESIHP_ITERCPU_DIR"
ENV_OTHER = "RESIHP_ITERCPU_OTHER"

SITE = '''
import os
_DIR = os.environ.get("RESIHP_ITERCPU_DIR")
_ID = (os.environ.get("RESIHP_DEVICE") if os.environ.get("RESIHP_JOB") else None) or (
    os.environ.get("RANK") if os.environ.get("LOCAL_RANK") is not None else None)
if _DIR and _ID is not None:
    import time
    _HZ = os.sysconf("SC_CLK_TCK")
    _FIRST = _ID == "0"
    _OTHER = os.environ.get("RESIHP_ITERCPU_OTHER") if _FIRST else None
    _PARENT = str(os.getppid()) if _FIRST else None

    def _cpu_of(pid):
        if pid is None:
            return -1.0
        try:
            with open(f"/proc/{pid}/stat") as f:
                s = f.read()
            x = s[s.rindex(")") + 2:].split()
            return (int(x[11]) + int(x[12])) / _HZ
        except (OSError, ValueError, IndexError):
            return -1.0

    _out = open(os.path.join(_DIR, f"worker{_ID}-{os.getpid()}.txt"), "a", buffering=1)

    def _hook(opt, args, kwargs):
        _out.write(f"{time.time():.6f} {time.process_time():.6f} {_cpu_of(_PARENT):.2f} {_cpu_of(_OTHER):.2f}\\n")

    import torch.optim.optimizer as _o
    _o.register_optimizer_step_post_hook(_hook)
'''


def install(root: Path) -> Path:
    """Write the ``sitecustomize`` under ``root`` and put it first on this process's
    ``PYTHONPATH`` (children inherit it); returns the folder to hand :func:`run_dir`."""
    site = root / "itercpu-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITE)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    os.environ[ENV_OTHER] = str(os.getpid())
    return site


def run_dir(root: Path, name: str) -> Path:
    """A fresh folder for one run's files, made the workers' target."""
    d = root / f"itercpu-{name}"
    d.mkdir(parents=True, exist_ok=True)
    os.environ[ENV_DIR] = str(d)
    return d


def read(folder: Path, warmup: int) -> dict:
    """Per iteration after ``warmup`` steps, from the step marks of every worker:
    ``worker_cpu_s`` (the workers' CPU summed: the job's CPU per iteration),
    ``worker_cpu_s_each`` (per worker), ``wall_s`` (the median worker's seconds per
    step), ``parent_cpu_s`` (the agent / torchrun launcher), ``other_cpu_s`` (the
    benchmark process: ResiHP's controller; NaN where not read). Each figure is a rate
    over the steps from ``warmup`` to each worker's last, not a median of gaps."""
    per, walls, parent, other = [], [], float("nan"), float("nan")
    for f in sorted(glob.glob(str(folder / "worker*.txt"))):
        rows = []
        for line in Path(f).read_text().splitlines():
            try:
                rows.append(tuple(float(x) for x in line.split()))
            except ValueError:
                continue
        if len(rows) < warmup + 2:
            continue
        a, b = rows[warmup], rows[-1]
        n = len(rows) - 1 - warmup
        per.append((b[1] - a[1]) / n)
        walls.append((b[0] - a[0]) / n)
        if Path(f).name.startswith("worker0-"):
            if a[2] >= 0 and b[2] >= 0:
                parent = (b[2] - a[2]) / n
            if a[3] >= 0 and b[3] >= 0:
                other = (b[3] - a[3]) / n
    if not per:
        return {"workers": 0}
    return {"workers": len(per), "worker_cpu_s": sum(per), "worker_cpu_s_each": per,
            "wall_s": statistics.median(walls), "parent_cpu_s": parent, "other_cpu_s": other}
