"""Core stays framework-neutral and cheap to import (DESIGN: dependencies point one way)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, sys, time
t = time.perf_counter()
import {module}
dt = time.perf_counter() - t
{after}
heavy = sorted(m for m in ("torch", "deepspeed", "accelerate") if m in sys.modules)
print(json.dumps({{"seconds": dt, "heavy": heavy}}))
"""


def probe(module: str, after: str = "") -> dict[str, object]:
    """Import ``module`` in a fresh interpreter; report time and heavy modules loaded."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESIHP_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module, after=after)],
        capture_output=True, text=True, timeout=60, env=env, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_resihp_core_is_fast_and_neutral() -> None:
    runs = [probe("resihp_core") for _ in range(3)]
    assert all(r["heavy"] == [] for r in runs), runs
    best = min(float(r["seconds"]) for r in runs)  # best of 3 cuts scheduler noise
    assert best < 0.3, f"import resihp_core took {best:.3f}s (limit 0.3s)"


@pytest.mark.parametrize(
    "module",
    [
        "resihp_core.hookspecs",
        "resihp_core.adapter",
        "resihp_core.plugins",
        "resihp_core.cli",
        "resihp_adapters.megatron_ref.plugin",
        "resihp_adapters.deepspeed.plugin",
    ],
)
def test_modules_import_no_framework(module: str) -> None:
    assert probe(module)["heavy"] == []


def test_loading_all_plugins_imports_no_framework() -> None:
    after = (
        "from resihp_core.plugins import get_plugins\n"
        "p = get_plugins(); p.adapters(); p.changepoint_detectors(); "
        "p.verification_strategies(); p.adaptation_stages()\n"
        "from resihp_core.cli import build_parser; build_parser()"
    )
    assert probe("resihp_core", after)["heavy"] == []
