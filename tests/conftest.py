"""Test-wide settings."""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time

import pytest
from hypothesis import settings

# Property tests check behaviour, not speed: on a loaded CI machine a single example can
# take longer than hypothesis' default 200 ms deadline without anything being wrong.
settings.register_profile("resihp", deadline=None)
settings.load_profile("resihp")

# Opt-in cost record: RESIHP_TEST_COST=<file> appends one JSON line per test with its wall
# time and the CPU seconds it cost (this process plus the children it waited for). On a
# machine shared with other work, CPU time is the steadier guide to what a test costs CI.
_COST_FILE = os.environ.get("RESIHP_TEST_COST")


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


if _COST_FILE:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        """Wall and CPU seconds of setup + call + teardown of one test."""
        wall, cpu = time.monotonic(), _cpu()
        yield
        row = {"test": item.nodeid, "wall_s": round(time.monotonic() - wall, 2),
               "cpu_s": round(_cpu() - cpu, 2), "load1": round(os.getloadavg()[0], 1)}
        with open(_COST_FILE, "a", encoding="utf-8") as out:
            out.write(json.dumps(row) + "\n")


@pytest.fixture(autouse=True)
def _torch_default_dtype():
    """A test that sets torch's default dtype (float64 runs) leaves it as it found it
    for the next one (Megatron-Core builds tensors in the default dtype)."""
    import sys

    torch = sys.modules.get("torch")
    before = torch.get_default_dtype() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_default_dtype(before if before is not None else torch.float32)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report on the item, for :func:`_harness_folders`."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"_resihp_{rep.when}", rep)


@pytest.fixture(autouse=True)
def _harness_folders(request):
    """The integration harness's temporary folders (``backend_harness.tmpdir``) are
    removed after a test that passed; a failed test keeps them for its logs."""
    yield
    harness = next((m for name, m in list(sys.modules.items()) if name.endswith("backend_harness")), None)
    made = getattr(harness, "MADE", None)
    if not made:
        return
    passed = all(getattr(getattr(request.node, f"_resihp_{w}", None), "passed", True) for w in ("setup", "call"))
    folders, made[:] = list(made), []
    if passed:
        for path in folders:
            shutil.rmtree(path, ignore_errors=True)
