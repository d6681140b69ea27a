"""The CPU bypasses of Megatron-Core (one module, applied only without CUDA): its CUDA
placements land on the CPU inside Megatron's modules and nowhere else."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")


def test_cpu_bypasses_place_cuda_buffers_on_the_cpu_only_inside_megatron():
    import torch

    from resihp_adapters.megatron_core import cpu

    if torch.cuda.is_available():
        pytest.skip("the bypasses apply only without CUDA")
    assert cpu.enable()
    from megatron.core.pipeline_parallel import schedules

    assert schedules.torch.zeros([], device="cuda").device.type == "cpu"
    assert schedules.torch.cuda.current_device() == "cpu"
    assert torch.cuda.current_device is not schedules.torch.cuda.current_device  # torch's own is untouched
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_clipping_sees_cuda_type_names_only_while_it_runs():
    import torch

    from resihp_adapters.megatron_core import cpu

    if torch.cuda.is_available():
        pytest.skip("the bypasses apply only without CUDA")
    cpu.enable()
    from megatron.core.optimizer import clip_grads, optimizer

    # float32, as Megatron's clipping wants: an earlier test of the session may have
    # changed the default dtype (Megatron builds its clip coefficient in the default one)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        p = torch.nn.Parameter(torch.ones(4))
        p.grad = torch.full((4,), 2.0)
        optimizer.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    finally:
        torch.set_default_dtype(default)
    assert torch.allclose(p.grad, torch.full((4,), 0.5, dtype=torch.float32), rtol=1e-5)
    assert p.grad.type() == "torch.FloatTensor"  # restored once clipping returned
    assert clip_grads.clip_grad_by_total_norm_fp32 is optimizer.clip_grad_by_total_norm_fp32
