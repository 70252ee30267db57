"""Each backend's declaration against the table of docs/formats.md (devices, activation
quantization, w13 rows, round-ups), written out here independently of the modules, so that a change
to either is a visible decision. Ids carry the architectures (``pytest -k gfx942``)."""

from __future__ import annotations

import pytest

from mxmoe.harness.contract.backend import BackendUnavailable, Declaration, VendorKernel
from mxmoe.harness.run.registry import discover
from mxmoe.harness.upstream.selection import GPT_OSS_PRIORITY, MOE_BACKENDS

# vLLM name: (archs, quant, w13 layout, hidden round-up, intermediate round-up, bias dtype)
DECLARED = {
    "FLASHINFER_TRTLLM_MXFP4_BF16": (("sm100",), "w4a16", "pair_swapped", 256, 128, "fp32"),
    "FLASHINFER_TRTLLM_MXFP4_MXFP8": (("sm100",), "w4a8-mxfp8", "pair_swapped", 256, 128, "fp32"),
    "FLASHINFER_CUTLASS_MXFP4_BF16": (("sm90",), "w4a16", "chunked_up_gate", 128, 128, "bf16"),
    # sm100 as first read; vLLM (0.26.0 to 0.34.0) also takes the scheme on SM12x (has_device_capability(100))
    "FLASHINFER_CUTLASS_MXFP4_MXFP8": (("sm100", "sm120"), "w4a8-mxfp8", "chunked_up_gate", 128, 128, "bf16"),
    # sm120 as vLLM 0.33.0 and 0.34.0 run it there (_triton_kernel_moe_supports_current_device: 9.0 <= capability
    # < 13.0, with SM12x's own opt-flag constraints); from vLLM's code, not run on an SM12x GPU
    "TRITON": (("sm90", "sm100", "sm120", "gfx942", "gfx950"), "w4a16", "interleaved", 32, 64, "fp32"),
    "TRITON_UNFUSED": (("sm90", "sm100", "sm120", "gfx942", "gfx950"), "w4a16", "chunked_gate_up", 32, 64, "fp32"),
    "MARLIN": (("sm80", "sm90", "sm100", "sm120"), "w4a16", "interleaved", 256, 128, "bf16"),
    "AITER_MXFP4_BF16": (("gfx950",), "w4a16", "chunked_gate_up", 256, 256, "fp32"),
    "AITER_TRITON_MXFP4_BF16": (("gfx942", "gfx950", "gfx1250"), "w4a16", "interleaved", 256, 256, "fp32"),
    "AITER_MXFP4_FP8": (("gfx950", "gfx1250"), "w4a8-fp8", "interleaved", 256, 256, "fp32"),
    "EMULATION": (("cpu", "sm80", "sm90", "sm100", "sm120", "gfx942", "gfx950", "gfx1250"), "w4a16", "interleaved",
                  32, 32, "bf16"),
}  # fmt: skip
LOADED = [item for item in discover() if item.backend.declaration.kind == "backend"]
VLLM = {item.backend.declaration.vllm_backend: item for item in LOADED if item.backend.declaration.vllm_backend}


def _id(d: Declaration) -> str:
    return f"{d.id}-{'-'.join(d.archs)}"


def test_every_backend_of_the_design_has_a_module():
    assert set(VLLM) == set(DECLARED)
    assert all(item.spec.startswith("mxmoe.kernels.") for item in VLLM.values())
    assert len({item.spec.split(":")[0] for item in VLLM.values()}) == len(DECLARED), "one module per backend"
    assert {"portable-triton", "portable-triton-chunked"} <= {item.backend.declaration.id for item in LOADED}


@pytest.mark.parametrize("name", list(DECLARED), ids=lambda n: _id(VLLM[n].backend.declaration))
def test_declaration_matches_the_table(name):
    d = VLLM[name].backend.declaration
    assert (d.archs, d.quant, d.w13_layout, d.hidden_align, d.intermediate_align, d.bias_dtype) == DECLARED[name]
    assert name in GPT_OSS_PRIORITY or name == "TRITON_UNFUSED"  # vLLM: "TRITON_UNFUSED has bug with MTP support"
    assert any(name in names for key, names in MOE_BACKENDS.items() if key != "auto"), "reachable by --moe-backend"


def test_ck_runs_on_gfx942_but_takes_mxfp4_only_on_gfx950():
    d = VLLM["AITER_MXFP4_BF16"].backend.declaration
    assert "gfx942" in d.device_archs and "gfx942" not in d.archs


@pytest.mark.parametrize(
    "item", [i for i in LOADED if isinstance(i.backend, VendorKernel)], ids=lambda i: _id(i.backend.declaration)
)
def test_vendor_backends_load_here_or_say_why_not(item, host_arch):
    """A vendor backend's load either succeeds, on a host of an arch it declares (where
    test_vendor_adapters then runs it and wants a PASS), or raises BackendUnavailable naming the
    backend and what is missing, never anything else."""
    b = item.backend
    try:
        b.load()
    except BackendUnavailable as exc:
        assert b.declaration.id in str(exc)
        return
    assert host_arch in b.declaration.archs + b.declaration.device_archs, f"{b.declaration.id} loaded on {host_arch}"
