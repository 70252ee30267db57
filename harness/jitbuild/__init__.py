"""Project-owned builds of the parts of vendors' JIT modules that the harness's kernels need.

FlashInfer compiles its SM90 CUTLASS MoE (``fused_moe_90``) on first use from ~180 translation
units: every activation x weight type the runner supports, each GEMM tile shape, about an hour
at 16 cores. The harness calls one path of it, MXFP4 weights x bf16 activations
(FLASHINFER_CUTLASS_MXFP4_BF16, the backend of the seeds' headline bug), which needs about a
tenth of those units. ``flashinfer_sm90`` builds just that subset with FlashInfer's own sources,
flags and ninja generator, into the ignored cache, and makes ``flashinfer.fused_moe`` load it;
nothing of FlashInfer is copied into this repository. What is left out of the module is left
out by construction (the runner is only ever built for bf16 x MXFP4), and the build refuses a
module that would still need a symbol of the parts left out.
"""
