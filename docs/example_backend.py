"""An external backend as a vendor would write one, in its own file: ``python -m harness check
--backend-file docs/example_backend.py:ExampleFp32``. It borrows the emulation's torch layer
(``TorchMoE``) for its arithmetic and declares what that arithmetic is; a real backend would call
its kernel in ``run`` and import its package in ``load``."""

from __future__ import annotations

import torch

from mxmoe.harness.contract.backend import Arithmetic, Declaration
from mxmoe.harness.contract.platforms import ARCHS
from mxmoe.harness.instruments.torch_moe import TorchMoE
from mxmoe.reference.moe import Precision


class ExampleFp32(TorchMoE):
    """float32 GEMMs on dequantized weights, the intermediate and the output in bf16."""

    gemm = "fp32"
    declaration = Declaration(
        id="example-fp32",
        archs=ARCHS,
        description="example external backend: fp32 GEMMs, bf16 intermediate and output",
        kind="backend",
        arithmetic=Arithmetic(precision=Precision(intermediate="bf16", output=torch.bfloat16)),
    )
