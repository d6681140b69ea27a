"""Device and backend choice from ``runtime.backend`` (docs/gpu.md): the rule every torch
adapter applies, the configuration errors that name the field, the NCCL abort hooks'
CPU behaviour and the chunk timer. What only a GPU can show is listed in docs/gpu.md."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from resihp_core.config import Config, ConfigError
from resihp_adapters.torchkit.device import CPU, AbortWatch, ChunkTimer, Placement, choose, placement_for


def test_gloo_is_the_cpu_and_auto_without_cuda_is_too():
    assert choose("gloo", local_rank=0, local_world=4, own_transfers=True, cuda_available=True, gpu_count=8) == CPU
    p = choose("auto", local_rank=1, local_world=4, own_transfers=True, cuda_available=False, gpu_count=0)
    assert (p.device, p.backend, p.init_backend, p.wire) == (torch.device("cpu"), "gloo", "gloo", torch.device("cpu"))


def test_auto_with_a_gpu_per_worker_is_nccl_on_the_local_rank():
    p = choose("auto", local_rank=3, local_world=4, own_transfers=False, cuda_available=True, gpu_count=4)
    assert p.device == torch.device("cuda", 3) and p.backend == "nccl"
    assert p.init_backend == "cpu:gloo,cuda:nccl"  # host tensors keep gloo
    assert p.wire == p.device


def test_shared_gpu_computes_there_only_for_adapters_that_own_their_transfers():
    own = choose("auto", local_rank=3, local_world=4, own_transfers=True, cuda_available=True, gpu_count=1)
    assert own.device == torch.device("cuda", 0) and own.backend == "gloo"
    assert own.wire == torch.device("cpu")  # every transfer staged through the host
    theirs = choose("auto", local_rank=3, local_world=4, own_transfers=False, cuda_available=True, gpu_count=1)
    assert theirs.device == torch.device("cpu") and "gloo cannot" in theirs.reason


@pytest.mark.parametrize("cuda,gpus,words", [(False, 0, "NCCL needs CUDA"), (True, 2, "one GPU per worker")])
def test_nccl_that_cannot_work_is_a_configuration_error_naming_the_field(cuda, gpus, words):
    with pytest.raises(ConfigError) as e:
        choose("nccl", local_rank=0, local_world=4, own_transfers=True, cuda_available=cuda, gpu_count=gpus)
    assert e.value.path == "runtime.backend" and words in str(e.value)
    assert str(e.value).startswith("runtime.backend = 'nccl'")
    with pytest.raises(ConfigError, match="runtime.backend"):
        choose("mpi", local_rank=0, local_world=1, own_transfers=True, cuda_available=False, gpu_count=0)


def test_workers_and_resihp_run_refuse_nccl_on_this_cpu_machine(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this check is about a machine without CUDA")
    # A worker: the adapter section carries runtime.backend (job_section of each adapter).
    with pytest.raises(ConfigError, match=r"runtime.backend = 'nccl': NCCL needs CUDA"):
        placement_for(5, {"backend": "nccl", "devices_per_node": 4}, own_transfers=True)
    assert placement_for(5, {"devices_per_node": 4}, own_transfers=False) == Placement(
        torch.device("cpu"), "gloo", "auto: no CUDA device")
    # resihp run refuses before any process starts.
    from resihp_core.runtime.controller.jobs import check_backend_here

    cfg = Config.from_dict({"runtime": {"backend": "nccl"}})
    with pytest.raises(ConfigError, match="runtime.backend = 'nccl'"):
        check_backend_here(cfg, "local")
    check_backend_here(cfg, "external")  # each remote worker checks its own host
    assert Config.from_dict({}).runtime.backend == "auto"


def test_every_adapter_section_carries_the_backend():
    from resihp_adapters.megatron_ref.plugin import job_section as ref_section
    from resihp_adapters.torch_native.adapter import parse_config
    from resihp_adapters.torch_native.plugin import job_section as tn_section

    cfg = Config.from_dict({"runtime": {"backend": "gloo", "devices_per_node": 2, "nodes": 2}})
    for section in (ref_section(cfg), tn_section(cfg)):
        assert (section["backend"], section["devices_per_node"]) == ("gloo", 2)
    parse_config(tn_section(cfg))  # torch_native's validation accepts them


def test_release_and_abort_watch_leave_gloo_groups_to_the_cpu_path():
    """On gloo nothing is aborted and no thread is started; release still ends the world."""
    import torch.distributed as dist

    from resihp_adapters.torchkit.device import abort_if_nccl, release_world

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert abort_if_nccl(CPU) is False and dist.is_initialized()
        watch = AbortWatch(CPU, lambda: True).start()
        assert not watch.needed and watch._thread is None
        watch.stop()
    finally:
        release_world(CPU)
    assert not dist.is_initialized()
    assert dist.distributed_c10d._world.group_count == 0


def test_abort_watch_aborts_once_superseded_and_stops_cleanly(monkeypatch):
    """The watcher's thread logic, with the NCCL abort replaced by a recorder (no NCCL here)."""
    import torch.distributed as dist

    nccl = Placement(torch.device("cuda", 0), "nccl")
    calls = []
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda group=None: calls.append(group))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    flag = threading.Event()
    watch = AbortWatch(nccl, flag.is_set, interval_s=0.01).start()
    assert watch.needed
    time.sleep(0.05)
    assert calls == []  # not superseded: nothing aborted
    flag.set()
    deadline = time.monotonic() + 5
    while not watch.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch.aborted and calls == [None]  # the whole world, once
    watch.stop()
    stopped = AbortWatch(nccl, lambda: True, interval_s=0.01)
    stopped._stop.set()  # stopped before it could run: must not abort
    stopped._run()
    assert calls == [None]


def test_abort_watch_grace_lets_an_idle_worker_keep_its_world(monkeypatch):
    """Superseded, a worker that stops the watch within the grace keeps its communicators
    (stop says nothing was aborted); one that does not (blocked) is aborted after it."""
    import torch.distributed as dist

    nccl = Placement(torch.device("cuda", 0), "nccl")
    calls = []
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda group=None: calls.append(group))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    idle = AbortWatch(nccl, lambda: True, interval_s=0.01, grace_s=5.0).start()
    time.sleep(0.1)  # superseded, inside the grace
    assert idle.stop() is False and calls == []
    blocked = AbortWatch(nccl, lambda: True, interval_s=0.01, grace_s=0.1).start()
    deadline = time.monotonic() + 5
    while not blocked.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert blocked.stop() is True and calls == [None]


def test_chunk_timer_measures_host_time_on_the_cpu():
    t = ChunkTimer(torch.device("cpu")).start()
    time.sleep(0.02)
    assert 0.015 < t.stop() < 5.0
