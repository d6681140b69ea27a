"""ResiHP core: framework-neutral detection, planning and plan IR.

Importing this package never imports torch or deepspeed. See :mod:`resihp_core.glossary`
for the words used throughout.
"""

from __future__ import annotations

from resihp_core.hookspecs import hookimpl
from resihp_core.plan import (
    Device,
    Migration,
    ParallelPlan,
    PlanError,
    ScheduleKind,
    Topology,
    parse_plan,
)
from resihp_core.program import Program, ProgramError, check_programs, format_grid

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "Device",
    "Migration",
    "ParallelPlan",
    "PlanError",
    "Program",
    "ProgramError",
    "ScheduleKind",
    "Topology",
    "check_programs",
    "format_grid",
    "hookimpl",
    "parse_plan",
]
