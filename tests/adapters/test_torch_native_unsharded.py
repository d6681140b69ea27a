"""A shard-degree-1 FSDP stage's unsharded parameters viewing its sharded data
(resihp_adapters.torch_native.unsharded): no copy per forward, the same bits as FSDP's
copy, and no alias where the copy is not the identity (a mixed-precision cast)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
nn = torch.nn


@pytest.fixture()
def world_of_one():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _stage(mesh, **kw) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    fully_shard(m, mesh=mesh, reshard_after_forward=False, **kw)
    return m


def _group(m: torch.nn.Module):
    return m._get_fsdp_state()._fsdp_param_group


def test_aliased_stage_steps_bit_for_bit_like_fsdps_copy_without_copying(world_of_one):
    from resihp_adapters.torch_native.unsharded import alias_unsharded, aliased

    ours, theirs = _stage(world_of_one), _stage(world_of_one)
    assert alias_unsharded(_group(ours)) == 4
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, foreach=True) for m in (ours, theirs)]
    x = torch.randn(5, 8, dtype=torch.float64)
    for _ in range(3):  # the step writes the sharded data in place: the next forward must see it
        outs = []
        for m, opt in zip((ours, theirs), opts):
            y = m(x)
            if m is ours:  # unsharded now: the module's parameters are the sharded data itself
                local = [fp._sharded_param_data.data_ptr() for fp in _group(m).fsdp_params]
                assert [p.data_ptr() for p in m.parameters()] == local
            y.square().sum().backward()
            opt.step()
            opt.zero_grad()
            outs.append(y.detach())
        assert torch.equal(outs[0], outs[1])
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a.to_local(), b.to_local())
    assert all(aliased(fp) for fp in _group(ours).fsdp_params)


def test_a_cast_before_the_forward_is_not_aliased(world_of_one):
    from resihp_adapters.torch_native.unsharded import alias_unsharded
    from torch.distributed.fsdp import MixedPrecisionPolicy

    m = _stage(world_of_one, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
    assert alias_unsharded(_group(m)) == 0
    assert m(torch.randn(5, 8, dtype=torch.float32)).dtype == torch.float32
