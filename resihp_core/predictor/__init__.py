"""Workload-aware cost model, pipeline schedules and the DAG simulator (docs/design.md §3.3-3.4).

Submodules import numpy lazily-by-module: importing this package imports nothing heavy."""
