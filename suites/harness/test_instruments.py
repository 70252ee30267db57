"""The harness's instruments against the kernels they stand in for."""

from mxmoe.harness.instruments.honest import HonestBiasAfter
from mxmoe.kernels.flashinfer_cutlass_mxfp4_bf16 import FlashInferCutlassMxfp4Bf16


def test_honest_bias_after_rounds_as_flashinfer_cutlass_declares():
    """``honest-bias-after`` is the clean control of FlashInfer CUTLASS's rounding order (products
    rounded to bf16 before the bias): its precision is written out in the instruments, which do not
    import the kernels, so this is where a change to either declaration shows."""
    ours = HonestBiasAfter.declaration.arithmetic.precision
    theirs = FlashInferCutlassMxfp4Bf16.declaration.arithmetic.precision
    assert ours == theirs
    assert ours.bias_after_rounding


def test_the_probes_archs_are_harness_archs():
    """vLLM's probe imports nothing of the harness (it runs beside vLLM's sources), so it names the
    architectures it can pretend to be itself; each must be one of the harness's."""
    from mxmoe.harness.contract.platforms import ARCHS
    from mxmoe.harness.upstream.vllm_probe import PROBE_ARCHS

    assert set(PROBE_ARCHS) <= set(ARCHS)


def test_honest_bf16_epilogue_rounds_as_marlin_declares():
    """``honest-bf16-epilogue`` is the clean control of MARLIN's rounding order (bf16 products, a
    bf16 bias add, a bf16 weighted row, an fp32 top-k sum); the same reason as above."""
    from mxmoe.harness.instruments.honest import HonestBf16Epilogue
    from mxmoe.kernels.marlin import Marlin

    ours = HonestBf16Epilogue.declaration.arithmetic.precision
    assert ours == Marlin.declaration.arithmetic.precision
    assert ours.bias_add_rounds and ours.combine == "bf16-terms"
    assert not Marlin.declaration.deterministic
