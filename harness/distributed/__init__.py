"""Distributed checks: one process per rank (torch.distributed: gloo on CPUs, NCCL on GPUs), each
running its shard of a layer through the same backend adapter as every other check, the shards
combined as production combines them, and the result judged against the unsharded oracle.

* ``shard``: how a layer is cut (tensor parallel: GPT-OSS's uneven block-aligned slices of the
  intermediate dimension, each padded to one partition width, the w2 bias on rank 0 only; expert
  parallel: a slice of experts per rank, tokens dispatched and combined as vLLM's naive
  all-gather / reduce-scatter does), the combined bound, and the planted sharding faults;
* ``rank``: what one rank process does;
* ``launch``: starting the ranks, surviving their deaths, recording the verdict.
"""

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""Set in every rank process and every CI job: NVLink multicast stays off, since a program that
uses it can take a shared host's GPUs out of service."""
