"""The words ResiHP uses, each with one meaning everywhere in the code.

device
    One accelerator (or, on CPU, one worker process slot). Identified by an int id,
    unique in the job.
rank
    The torch.distributed rank of the worker process driving one device in the current
    plan generation. Ranks are renumbered at each generation; device ids never are.
node
    A host; its devices share a fast intra-node link (NVLink/NVSwitch) and one agent.
replica
    A data-parallel (DP) group: one full copy of the model split into stages.
stage
    A pipeline-parallel (PP) stage: a contiguous range of layers. All replicas share
    the same layer ranges.
TP group
    The devices that together run one stage of one replica with tensor parallelism.
    Its degree is its size, always a power of two; degrees may differ between replicas
    and stages (heterogeneous TP).
micro-batch
    One packed sequence chunk of token budget N. Micro-batch (r, j) is the j-th
    micro-batch of replica r's share of the global batch; it may be *executed* for a
    stage by another replica (migration) without changing training semantics.
iteration
    One optimizer step over the global batch (all micro-batches of all replicas).
plan generation
    A counter bumped on every reconfiguration; process groups and store keys of an
    older generation are never reused.
"""
