"""torch-native adapter: torch.distributed.pipelining stages, FSDP2 data parallelism."""
