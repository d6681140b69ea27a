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
