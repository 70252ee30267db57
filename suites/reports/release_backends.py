"""Backends of a release under sign-off, each wrong in one way a report must place, loaded by the
report tests as an outside backend arrives (a file). Each is honest except where its docstring says."""

from __future__ import annotations

import torch

from mxmoe.harness.contract.backend import Arithmetic, BackendUnavailable, Declaration, XFail
from mxmoe.harness.contract.platforms import ARCHS
from mxmoe.harness.instruments.torch_moe import TorchMoE
from mxmoe.reference.moe import Precision

_FUSED = Arithmetic(precision=Precision(intermediate="bf16", output=torch.bfloat16))
_KNOWN = "https://example.org/upstream/issue/7"


def _declare(id_: str, description: str, **kw: object) -> Declaration:
    return Declaration(id=id_, archs=ARCHS, description=description, arithmetic=_FUSED, **kw)


class WrongSignAt7(TorchMoE):
    """Negates its output at T=7 (a FAIL there) while ``broken``; the release before was not."""

    declaration = _declare("wrongsign-kernel", "negated output at T=7")
    broken = True

    def run(self, prepared, inputs, out):
        super().run(prepared, inputs, out)
        if inputs.case.tokens == 7 and self.broken:
            out.neg_()


class RaisesAt3(TorchMoE):
    """Raises at T=3 (an ERROR there) while ``broken``."""

    declaration = _declare("raising-kernel", "RuntimeError at T=3")
    broken = True

    def run(self, prepared, inputs, out):
        if inputs.case.tokens == 3 and self.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        super().run(prepared, inputs, out)


class KnownBug(TorchMoE):
    """Declares a strict xfail at T=1 and T=7 but is wrong only at T=7: XFAIL at 7, XPASS at 1."""

    declaration = _declare(
        "known-bug-kernel",
        "declared broken at T=1 and T=7, broken only at 7",
        xfails=(XFail(when={"tokens": 1}, reason="upstream bug", link=_KNOWN),
                XFail(when={"tokens": 7}, reason="upstream bug", link=_KNOWN)),
    )  # fmt: skip

    def run(self, prepared, inputs, out):
        super().run(prepared, inputs, out)
        if inputs.case.tokens == 7:
            out.mul_(3)


class HonestOutside(TorchMoE):
    """An honest production kernel from outside the project (fp32 GEMMs, bf16 intermediate)."""

    declaration = _declare("honest-outside-kernel", "honest: fp32 GEMMs, bf16 between them")

    def provenance(self) -> str | None:
        return "outside-moe 1.2.3 (wheel)"


class NeedsVendor(TorchMoE):
    """Its vendor package is missing on every host: SKIP everywhere."""

    declaration = _declare("needs-vendor-kernel", "needs a package no host has")

    def load(self) -> None:
        raise BackendUnavailable("needs-vendor-kernel needs the package 'vendor_moe' (pip: vendor-moe)")


class DeclinesEverything(TorchMoE):
    """Loads, then declines every case it sees (as vLLM's oracle refuses a deployment on a host that
    lacks a package): SKIPs that name why, never a verdict."""

    declaration = _declare("declines-everything-kernel", "loads, declines every case")

    def convert(self, inputs):
        raise BackendUnavailable("the deployment is refused on this host (it requires amd-quark)")
