"""An honest backend that notes, in the file named by MXMOE_DEVICE_LOG, which process ran it on which
device: the GPU-pinning tests read it to see that each worker had its own GPU."""

from __future__ import annotations

import os

import torch

from mxmoe.harness.contract.backend import Arithmetic, Declaration
from mxmoe.harness.contract.platforms import ARCHS
from mxmoe.harness.instruments.torch_moe import TorchMoE
from mxmoe.reference.moe import Precision


class DeviceProbe(TorchMoE):
    declaration = Declaration(id="device-probe", archs=ARCHS, description="notes its process and device",
                              arithmetic=Arithmetic(precision=Precision(intermediate="bf16", output=torch.bfloat16)))

    def run(self, prepared, inputs, out):
        super().run(prepared, inputs, out)
        with open(os.environ["MXMOE_DEVICE_LOG"], "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} {out.device}\n")
