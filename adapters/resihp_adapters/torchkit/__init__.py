"""Torch pieces every torch-based adapter needs (``docs/adapters.md``):

* :mod:`.comm` — per-generation communicators, heterogeneous-TP point-to-point and DP
  reduction across TP degrees;
* :mod:`.transfer` — the state-transfer plan between two plans' layouts;
* :mod:`.checkpoint` — verified, atomic checkpoint files.
* :mod:`.device` — the device and backend of a worker from ``runtime.backend``, NCCL
  aborts on failure, device-time chunk timers (``docs/gpu.md``).
"""
