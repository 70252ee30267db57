"""A backend module that fails at import, as vLLM PR #50622's split-out module did (it used a name
it no longer imported): its cases must be ERRORs carrying the NameError, and the others must run."""

from mxmoe.harness.instruments.torch_moe import TorchMoE


class SplitOutMoE(TorchMoE):
    declaration = MXFP4_DECLARATION  # noqa: F821 (the bug under test)
