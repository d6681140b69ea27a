#!/usr/bin/env bash
# Create .venv and install ResiHP with every extra, pinned by constraints.txt.
# Idempotent: a second run only re-checks the pins.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# PIP_CONSTRAINT also pins the isolated build environment (setuptools).
PIP_CONSTRAINT=constraints.txt .venv/bin/python -m pip install -q -c constraints.txt -e ".[deepspeed,accelerate,hf,dev,peers,megatron-core]"
# Byte-compile the project's own sources (site-packages are compiled by pip). Where
# PYTHONDONTWRITEBYTECODE is set, Python never writes these itself, so every worker,
# agent and controller process would recompile each project module it imports; stale
# files are harmless (a changed source is recompiled in memory, as without them).
.venv/bin/python -m compileall -q -j 0 resihp_core adapters plugins examples tests
