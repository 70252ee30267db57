"""The vendor adapters: run and passing where this host can run them, SKIP reasons elsewhere; lazy imports, the fetch
of OpenAI triton_kernels out of a vLLM wheel, the pure-torch parts of the triton_kernels and
FlashInfer adapters (bit matrix, the SM90 layouts of each FlashInfer generation, enum members by
name), the vLLM layer driver's mapping, and the triton_kernels adapters' opt-flag constraints and
layouts on each CUDA arch against vLLM 0.34.0's own functions (SM12x's from vLLM's code: no SM12x GPU
ran them). What needs a GPU ran on the H200 (issue 6 note)."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from mxmoe.harness.contract.backend import BackendUnavailable, VendorKernel
from mxmoe.harness.contract.cases import make_case
from mxmoe.harness.contract.convert import Target, convert_weights
from mxmoe.harness.contract.inputs import make_inputs
from mxmoe.harness.judge.engine import run_case
from mxmoe.harness.run.registry import discover
from mxmoe.harness.upstream.fetch import NEWEST_VLLM, VendorMissing, extract_triton_kernels
from mxmoe.harness.upstream.selection import MOE_BACKENDS
from mxmoe.kernels import flashinfer_common as fic
from mxmoe.kernels import storage
from mxmoe.kernels.oai_triton import HOPPER_MIN_N, OaiTriton, pack_topk_bits
from mxmoe.kernels.oai_triton_unfused import OaiTritonUnfused
from mxmoe.kernels.vllm_layer import DRIVEN, MOE_BACKEND_STRINGS

LOADED = discover()
VENDOR = [i.backend for i in LOADED if isinstance(i.backend, VendorKernel)]
ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env}, timeout=300
    )


def test_importing_every_backend_imports_no_vendor_package():
    """Declarations, conversions and selection work without any vendor package: none is imported
    until a backend's ``load`` (on a host that can run it)."""
    code = (
        "import sys; from mxmoe.harness.run.registry import discover; discover(); "
        "print(sorted(m for m in ('flashinfer', 'triton_kernels', 'aiter', 'vllm') if m in sys.modules))"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("backend", VENDOR, ids=lambda b: b.declaration.id)
@pytest.mark.device_case(make_case("gptoss20b", 1))
def test_vendor_backends_run_where_they_can_and_skip_with_the_reason_elsewhere(backend, host_arch):
    """Each vendor backend on each arch it declares: on an arch this host lacks, a SKIP naming the
    hardware; on this host's arch, either it loads and then must run and PASS (an instrument built to
    fail there must FAIL over the bound instead: ``Backend.built_to_fail``), or it cannot load and
    the SKIP names the backend and why (its package or build is missing, with the command that
    builds it). Never a SKIP where the kernel could have run."""
    d = backend.declaration
    case = make_case("gptoss20b", 1)
    for arch in d.archs:
        result, _ = run_case(backend, case, arch)
        declined = backend.supports(case, arch)
        if declined:
            assert (result.outcome, result.reason) == ("SKIP", declined)
        elif arch != host_arch:
            assert (result.outcome, result.reason) == ("SKIP", f"needs {arch} hardware; this host is {host_arch}")
        elif result.outcome == "SKIP" and result.reason.startswith(f"{d.id} cannot run this case: "):
            # It loaded, and declined once it saw the case (vLLM's oracle refusing a deployment):
            # the kernel did not run, and the reason is the backend's own.
            assert len(result.reason) > len(f"{d.id} cannot run this case: ") and not result.metrics.elements
        elif result.outcome == "SKIP":
            assert result.reason.startswith(f"{d.id} cannot run here: "), result.reason
            with pytest.raises((ImportError, BackendUnavailable)):
                backend.load()
            if "compiled here" in result.reason or "compiled ops" in result.reason:  # a build is missing: say which
                assert "python -m harness build-" in result.reason or "flashinfer-jit-cache" in result.reason, (
                    result.reason)  # fmt: skip
        elif backend.built_to_fail():
            assert d.kind == "instrument", f"{d.id} is judged as a production kernel and cannot be built to fail"
            assert result.outcome == "FAIL" and result.metrics.worst_ratio > 1, (
                f"{result.test_id}: must show {backend.built_to_fail()}; got {result.outcome} "
                f"{result.metrics.worst_ratio:.3g}x: {result.reason}\n{result.traceback}"
            )
        else:
            assert result.outcome == "PASS", f"{result.test_id}: {result.outcome} {result.reason}\n{result.traceback}"
    if "cpu" not in d.archs:
        result, _ = run_case(backend, case, "cpu")
        assert result.outcome == "SKIP" and "does not run on cpu" in result.reason


def _wheel(tmp_path: Path, files: dict[str, str]) -> Path:
    path = tmp_path / "vllm-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_fetch_takes_only_the_vendored_triton_kernels_out_of_a_wheel(tmp_path):
    wheel = _wheel(
        tmp_path,
        {
            "vllm/__init__.py": "",
            "vllm/third_party/triton_kernels/__init__.py": "ORIGIN = 'vendored'\n",
            "vllm/third_party/triton_kernels/matmul_ogs.py": "",
            "vllm/third_party/triton_kernels/routing.py": "",
            "vllm/third_party/triton_kernels/tensor_details/layout.py": "",
            "vllm/model_executor/other.py": "",
        },
    )
    root = tmp_path / "cache" / "vendor" / "tk"
    pkg = extract_triton_kernels(wheel, root)
    got = sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*") if p.is_file())
    assert got == ["SOURCE.txt", "__init__.py", "matmul_ogs.py", "routing.py", "tensor_details/layout.py"]
    # found at run time from the cache, when nothing is installed, by its own name
    code = (
        "import sys; sys.modules.pop('triton_kernels', None); "
        "from pathlib import Path; from mxmoe.harness.upstream import fetch; "
        "fetch.triton_kernels_root = lambda v=None: Path(sys.argv[-1]); "
        "m = fetch.import_triton_kernels(); print(m.ORIGIN)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(root)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "vendored"


def test_a_wheel_without_triton_kernels_is_refused(tmp_path):
    wheel = _wheel(tmp_path, {"vllm/__init__.py": ""})
    with pytest.raises(VendorMissing, match="no vllm/third_party/triton_kernels/__init__.py"):
        extract_triton_kernels(wheel, tmp_path / "out")


def test_pypi_lookalike_triton_kernels_is_refused(tmp_path):
    """PyPI's unrelated 'triton-kernels' takes the import name; it must never be used."""
    fake = tmp_path / "site" / "triton_kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    code = "from mxmoe.harness.upstream import fetch; fetch.import_triton_kernels()"
    proc = _run(code, PYTHONPATH=str(tmp_path / "site"), MXMOE_CACHE=str(tmp_path / "empty-cache"))
    assert proc.returncode != 0
    assert "not OpenAI's v3.5.1 API" in proc.stderr and "python -m harness fetch triton-kernels" in proc.stderr


def test_topk_bit_matrix_packs_each_local_choice_once():
    ids = torch.tensor([[0, 31], [32, 63], [-1, 5], [64, -1]])
    bits = pack_topk_bits(ids, 65).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    expect = torch.zeros(4, 3, dtype=torch.int64)
    for t, row in enumerate(ids.tolist()):
        for e in row:
            if e >= 0:
                expect[t, e // 32] |= 1 << (e % 32)
    assert torch.equal(bits, expect)


def test_triton_declines_what_it_cannot_compile_with_the_reason():
    small = make_case("small", 7)  # H = 128, 2I = 128: below Hopper's BLOCK_N = 256 tiles
    why = OaiTriton().supports(small, "sm90")
    assert why and f"N >= {HOPPER_MIN_N}" in why and "GEMM2 N = 128" in why
    assert OaiTriton().supports(small, "sm100") is None  # the assertion is Hopper's
    assert OaiTriton().supports(make_case("gptoss20b", 7), "sm90") is None
    assert "beta" in OaiTriton().supports(make_case("gptoss20b", 7, beta=0.5), "sm90")
    assert OaiTritonUnfused().supports(make_case("gptoss20b", 7, beta=0.5), "sm90") is None


@pytest.mark.parametrize(
    "version, generation",
    [(None, "0.6.10"), ("0.6.9", "0.6.9"), ("0.6.10", "0.6.10"), ("0.6.14", "0.6.10"), ("0.6.15.post1", "0.6.10"),
     ("0.6.16", "0.6.16"), ("0.6.18rc1", "0.6.16"), ("0.7.4", "0.6.16")],
)  # fmt: skip
def test_flashinfer_sm90_layout_is_chosen_by_version(version, generation):
    assert fic.sm90_generation(version) == generation


@pytest.mark.parametrize("generation", sorted(fic.SM90_LAYOUTS))
def test_each_sm90_generation_converts_and_inverts_bit_for_bit(generation):
    """A gpt-oss-20b TP4 shard (K = 2880 -> 2944 > 128, rows not a power of two), through each
    generation's storage and back, with the padded regions zero."""
    inputs = make_inputs(make_case("gptoss20b", 1, tp=4, tp_rank=3), "cpu")
    w = inputs.weights
    roles = ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales", "w13_bias", "w2_bias")
    sub = type(w)(**{**w.__dict__, **{k: getattr(w, k)[:2] for k in roles}})
    target = Target("chunked_up_gate", 2944, 768, "bf16", fic.SM90_LAYOUTS[generation])
    conv = convert_weights(sub, target)
    back = conv.canonical()
    for role in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales", "w13_bias", "w2_bias"):
        assert torch.equal(getattr(back, role), getattr(sub, role)), role
    ones = lambda t: sum(int(((t >> b) & 1).sum()) for b in range(8))  # noqa: E731
    for role in ("w13_blocks", "w2_blocks", "w13_scales", "w2_scales"):  # bytes and bits move, zeros are added
        assert ones(conv.tensors[role].view(torch.uint8)) == ones(getattr(sub, role)), role


def test_sm90_weight_repack_matches_flashinfer_0_6_16_kernel_loop():
    """The 0.6.16 repack against a literal transcription of its CUDA kernel's loop
    (``moe_gemm_mixed_utils.cu``: block(16, 32), one 32-bit word per lane)."""
    w = torch.randint(0, 256, (32, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    n, kb = w.shape
    loop = torch.zeros_like(w)
    wi = w.to(torch.int64)
    for block_id in range(n // 2):
        for p in range(kb // 32):
            for lane in range(16):
                row = block_id // 8 * 16 + block_id % 8
                mma = lane // 4
                dst = row + (mma % 2) * 8
                il = lane // 8 * 16 + (lane % 4) * 4
                col = p * 32 + mma * 8 + lane % 4
                raw = int(wi[row, col]) | int(wi[row + 8, col]) << 8 | int(wi[row, col + 4]) << 16
                raw |= int(wi[row + 8, col + 4]) << 24
                v = 0
                for mask, shift in storage.SM90_REPACK_MASKS:
                    v |= ((raw & mask) << shift) if shift >= 0 else ((raw & mask) >> -shift)
                for i in range(4):
                    loop[dst, p * 32 + il + i] = (v >> (8 * i)) & 0xFF
    ours = storage.sm90_weight_repack().forward(w[None], "w13_blocks")[0]
    assert torch.equal(ours, loop)


def test_sm90_weight_repack_by_slices_of_experts_is_the_same_bytes(monkeypatch):
    """The repack works on slices of experts (``storage.by_experts``) so that its int64 copies stay
    small at gpt-oss-120b: slices of one, two and three experts of seven (the last slice short)
    give the bytes of the whole tensor at once, forward and back."""
    w = torch.randint(0, 256, (7, 32, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    step = storage.sm90_weight_repack()
    monkeypatch.setattr(storage, "WIDENED_SLICE_BYTES", w.numel())
    whole = step.forward(w, "w13_blocks")
    for experts in (1, 2, 3):
        monkeypatch.setattr(storage, "WIDENED_SLICE_BYTES", experts * w[0].numel())
        assert torch.equal(step.forward(w, "w13_blocks"), whole), experts
        assert torch.equal(step.inverse(whole, "w13_blocks", w.shape), w), experts


def test_sm90_scale_fold_is_flashinfer_0_6_16_formula():
    s = torch.randint(0, 256, (2, 128, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    out = storage.sm90_scale_fold().forward(s, "w13_scales")
    assert out.shape == (2, 2, 3, 16, 16)
    for e, rb, kb, fm, ms, g in [(0, 0, 0, 0, 0, 0), (1, 1, 2, 15, 3, 3), (0, 1, 1, 7, 2, 1)]:
        assert out[e, rb, kb, fm, 4 * ms + g] == s[e, 64 * rb + 16 * ms + fm, 4 * kb + g]


def test_flashinfer_enum_members_are_looked_up_by_name_with_a_clear_error():
    import enum

    class Routing(enum.IntEnum):
        Default = 0
        Renormalize = 1

    assert fic.enum_member(Routing, "Renormalize", "RoutingMethodType") is Routing.Renormalize
    with pytest.raises(BackendUnavailable, match="no RoutingMethodType.Sigmoid; it has Default, Renormalize"):
        fic.enum_member(Routing, "Sigmoid", "RoutingMethodType")


def test_installed_flashinfer_has_every_routing_method_the_trtllm_backends_declare():
    """Drift check against the installed FlashInfer: the names the adapters pass exist as members."""
    fi = pytest.importorskip("flashinfer.fused_moe", reason="flashinfer-python is not installed")
    routing, activation = fic.enums(fi)
    declared = {
        m for b in VENDOR if b.declaration.id.startswith("flashinfer-trtllm") for m in b.declaration.routing_methods
    }
    assert declared and all(fic.enum_member(routing, m, "RoutingMethodType").name == m for m in declared)
    assert fic.enum_member(activation, "Swiglu", "ActivationType")


def test_a_flashinfer_cutlass_tactic_forces_both_gemms_and_leaves_the_autotuner_as_it_was(monkeypatch):
    """``forced_tactic``: GEMM1's choice is the config's index, GEMM2's the same config in its own
    list (GEMM1's count plus it), other ops are the AutoTuner's own; afterwards the AutoTuner answers
    as before; a runner whose lists are not the known ones is refused, not indexed blindly. On the
    installed FlashInfer's real AutoTuner object, with its choice stubbed (no GPU here)."""
    pytest.importorskip("flashinfer.autotuner", reason="flashinfer-python is not installed (`./dev test` installs it)")
    from types import SimpleNamespace

    from flashinfer.autotuner import AutoTuner

    from mxmoe.kernels.flashinfer_cutlass_mxfp4_bf16 import (
        FI_CUTLASS_TACTICS,
        SM90_W4A16_CONFIGS,
        FlashInferCutlassMxfp4Bf16,
        FlashInferCutlassMxfp4Bf16OldLayout,
        forced_tactic,
    )

    tuner = AutoTuner.get()
    monkeypatch.setattr(type(tuner), "choose_one", lambda self, op, runners, *a, **k: (runners[0], -1))

    def runner(count: int) -> SimpleNamespace:
        counts = SimpleNamespace(get_gemm1_tactic_count=lambda: count, get_gemm2_tactic_count=lambda: count)
        return SimpleNamespace(fused_moe_runner=counts)

    r, n = runner(len(SM90_W4A16_CONFIGS)), len(SM90_W4A16_CONFIGS)
    with forced_tactic(5):
        assert tuner.choose_one("trtllm::fused_moe::gemm1", [r], None, [], gemm_idx=1) == (r, 5)
        assert tuner.choose_one("trtllm::fused_moe::gemm2", [r], None, [], gemm_idx=2) == (r, n + 5)
        assert tuner.choose_one("flashinfer::other_op", [r], None, []) == (r, -1)
        with pytest.raises(RuntimeError, match="lists 116 GEMM1 and 116 GEMM2 tactics"):
            tuner.choose_one("trtllm::fused_moe::gemm1", [runner(116)], None, [])
    assert "choose_one" not in vars(tuner)
    assert tuner.choose_one("trtllm::fused_moe::gemm1", [r], None, []) == (r, -1)
    with forced_tactic(None):
        assert "choose_one" not in vars(tuner)

    # one tactic per distinct kernel: every tile and cluster but the 64x128 tiles (the 64x64 kernel)
    configs = [dict(t.settings)["config"] for t in FI_CUTLASS_TACTICS]
    assert len(SM90_W4A16_CONFIGS) == 28 and configs == [i for i in range(28) if not 12 <= i < 16]
    assert FlashInferCutlassMxfp4Bf16.declaration.tactics == FI_CUTLASS_TACTICS
    assert FlashInferCutlassMxfp4Bf16OldLayout.declaration.tactics == ()
    forced = FlashInferCutlassMxfp4Bf16()
    forced.with_tactic("m128n64c22")
    assert forced.declaration.id == "flashinfer-cutlass-mxfp4-bf16-tactic-m128n64c22"
    import mxmoe.kernels.flashinfer_cutlass_mxfp4_bf16 as fcm

    monkeypatch.setattr(fic.FlashInferKernel, "check_call", lambda self: None)
    monkeypatch.setattr(fcm, "installed_version", lambda: "0.7.4")
    with pytest.raises(BackendUnavailable, match="FlashInfer 0.7.4 is installed, whose list differs"):
        forced.check_call()


def test_flashinfer_jit_compile_is_refused_unless_asked(monkeypatch, tmp_path):
    pytest.importorskip("flashinfer.jit", reason="flashinfer-python is not installed")
    from flashinfer.jit import env as jit_env

    monkeypatch.setattr(jit_env, "FLASHINFER_AOT_DIR", tmp_path / "aot", raising=False)
    monkeypatch.setattr(jit_env, "FLASHINFER_JIT_DIR", tmp_path / "jit", raising=False)
    monkeypatch.setenv("MXMOE_CACHE", str(tmp_path / "cache"))  # no project-built subset either
    monkeypatch.delenv(fic.JIT_OPT_IN, raising=False)
    with pytest.raises(
        BackendUnavailable,
        match="fused_moe_90 is neither prebuilt nor compiled.*MXMOE_FLASHINFER_JIT=1.*harness build-flashinfer",
    ):
        fic.require_compiled("fused_moe_90", "flashinfer-cutlass-mxfp4-bf16")
    with pytest.raises(BackendUnavailable, match="fused_moe_100 is neither") as refused:
        fic.require_compiled("fused_moe_100", "flashinfer-cutlass-mxfp4-mxfp8")
    assert "build-flashinfer" not in str(refused.value)  # the subset is the SM90 bf16 x MXFP4 one only
    (tmp_path / "jit" / "fused_moe_90").mkdir(parents=True)
    (tmp_path / "jit" / "fused_moe_90" / "fused_moe_90.so").write_bytes(b"")
    fic.require_compiled("fused_moe_90", "flashinfer-cutlass-mxfp4-bf16")
    monkeypatch.setenv(fic.JIT_OPT_IN, "1")
    fic.require_compiled("fused_moe_99", "x")


def test_vllm_driver_stands_for_every_vllm_backend_with_its_declaration():
    ours = {i.backend.declaration.vllm_backend: i.backend for i in LOADED if i.backend.declaration.vllm_backend}
    driven = {cls.vllm_backend: cls for cls in DRIVEN}
    assert set(driven) | {"MARLIN"} == set(ours)
    for name, cls in driven.items():
        d, base = cls.declaration, ours[name].declaration
        assert d.id == f"vllm-{base.id}" and d.vllm_backend is None
        assert (d.archs, d.quant, d.arithmetic, d.hidden_align, d.intermediate_align) == (
            base.archs, base.quant, base.arithmetic, base.hidden_align, base.intermediate_align)  # fmt: skip
    for name, string in MOE_BACKEND_STRINGS.items():
        assert name in MOE_BACKENDS[string], f"--moe-backend {string} does not reach {name}"


def _cached_triton_kernels() -> bool:
    from mxmoe.harness.upstream.fetch import triton_kernels_root

    return (triton_kernels_root() / "triton_kernels" / "__init__.py").is_file()


@pytest.mark.skipif(
    not _cached_triton_kernels(),
    reason="triton_kernels is not fetched (python -m harness fetch triton-kernels; ./dev does it without a GPU)",
)
def test_triton_kernels_has_what_the_adapters_call_and_reads_our_weights_as_declared():
    """API drift against the fetched copy (v3.5.1 from vLLM 0.26.0's wheel), and the point that
    is easy to get wrong: triton_kernels reads an FP4 tensor's stride-1 dimension as the packed
    one, so the [E, K, N] views of the conversion must read as K = H (w13) and K = I (w2)."""
    from mxmoe.kernels.oai_triton import _load_modules

    tk = _load_modules()
    for mod, names in {
        "matmul_ogs": ("matmul_ogs", "FnSpecs", "FusedActivation", "PrecisionConfig", "FlexCtx"),
        "routing": ("routing", "routing_from_bitmatrix"),
        "topk": ("topk",),
        "tensor": ("Bitmatrix", "FP4", "wrap_torch_tensor", "convert_layout"),
        "numerics": ("InFlexData",),
        "swiglu": ("swiglu_fn",),
        "layout": ("make_default_matmul_mxfp4_w_layout", "make_default_matmul_mxfp4_w_scale_layout", "StridedLayout"),
        "opt_flags": ("update_opt_flags_constraints",),
    }.items():
        missing = [n for n in names if not hasattr(getattr(tk, mod), n)]
        assert not missing, f"triton_kernels.{mod} lacks {missing}"
    inputs = make_inputs(make_case("odd", 3), "cpu")
    conv = OaiTriton().convert_weights(inputs)
    e, h, i = inputs.case.experts, conv.target.hidden, conv.target.intermediate
    w13 = tk.tensor.wrap_torch_tensor(conv.tensors["w13_blocks"], dtype=tk.tensor.FP4)
    w2 = tk.tensor.wrap_torch_tensor(conv.tensors["w2_blocks"], dtype=tk.tensor.FP4)
    assert list(w13.shape) == [e, h, 2 * i] and list(w2.shape) == [e, i, h]
    hopper = tk.layout.HopperMXValueLayout
    swizzled = tk.tensor.convert_layout(w13, hopper, mx_axis=1)
    assert list(swizzled.shape) == [e, h, 2 * i]


# --- SM12x (and every CUDA arch): the opt-flag constraints and layouts against vLLM 0.34.0's own code ---
# vLLM's functions are taken out of its fetched sources (python -m harness fetch vllm --vllm-version 0.34.0)
# by name and run here, on a fake CUDA platform of each capability, with triton_kernels' calls recorded:
# nothing of vLLM is imported. No SM12x GPU ran any of it; these check the settings, not the kernels' results.

_VLLM_TRITON_MOE = "vllm/model_executor/layers/fused_moe/experts/gpt_oss_triton_kernels_moe.py"
_VLLM_MXFP4_UTILS = "vllm/model_executor/layers/quantization/utils/mxfp4_utils.py"
_CUDA_CAPS = {"sm90": (9, 0), "sm100": (10, 0), "sm120": (12, 0), "sm121": (12, 1)}


def _vllm_source(rel: str) -> Path:
    from mxmoe.harness.upstream.vllm_drift import vllm_root

    return vllm_root(NEWEST_VLLM) / rel


_needs_vllm_and_tk = pytest.mark.skipif(
    not (
        _cached_triton_kernels()
        and _vllm_source(_VLLM_TRITON_MOE).is_file()
        and _vllm_source(_VLLM_MXFP4_UTILS).is_file()
    ),
    reason="needs vLLM 0.34.0's sources and triton_kernels (python -m harness fetch vllm --vllm-version 0.34.0; "
    "python -m harness fetch triton-kernels; ./dev does both without a GPU)",
)


class _FakeCuda:
    """vLLM's ``current_platform`` on a CUDA device of capability CAP, as far as these functions ask."""

    def __init__(self, cap: tuple[int, int]):
        self.cap = cap

    def is_cuda(self):
        return True

    def is_rocm(self):
        return False

    def is_device_capability(self, capability):  # vLLM's Platform.is_device_capability
        return self.cap == capability if isinstance(capability, tuple) else self.cap[0] * 10 + self.cap[1] == capability

    def is_device_capability_family(self, capability):  # vLLM's Platform.is_device_capability_family
        return (self.cap[0] * 10 + self.cap[1]) // 10 == capability // 10


def _vllm_defs(rel: str, names: tuple[str, ...], namespace: dict) -> dict:
    """The top-level functions and assignments NAMES of vLLM's source REL, executed in NAMESPACE."""
    import ast

    path = _vllm_source(rel)
    tree = ast.parse(path.read_text())

    def name(node: ast.stmt) -> str | None:
        if isinstance(node, ast.FunctionDef):
            return node.name
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            return node.targets[0].id
        return None

    nodes = [n for n in tree.body if name(n) in names]
    assert sorted(name(n) for n in nodes) == sorted(names), f"{path} no longer defines {names}"
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


@pytest.fixture
def recorded_tk(monkeypatch):
    """The fetched triton_kernels, with the opt-flag constraints recorded instead of set and the
    layout conversions recorded instead of done; the CUDA capability its default layouts see is
    ``tk.cap``."""
    from mxmoe.kernels.oai_triton import _load_modules

    tk = _load_modules()
    tk.constraints, tk.conversions, tk.cap = [], [], (9, 0)
    monkeypatch.setattr(tk.opt_flags, "update_opt_flags_constraints", lambda c: tk.constraints.append(dict(c)))

    def convert(t, layout, **opts):
        tk.conversions.append((t.storage.data.clone(), tuple(t.shape), t.dtype, layout, opts))
        return t

    monkeypatch.setattr(tk.tensor, "convert_layout", convert)
    monkeypatch.setattr(tk.layout, "cuda_capability_geq", lambda major, minor=0: tk.cap >= (major, minor))
    monkeypatch.setattr(tk.layout, "is_hip_cdna4", lambda: False)
    return tk


@_needs_vllm_and_tk
@pytest.mark.parametrize("arch", sorted(_CUDA_CAPS))
def test_weight_swizzle_is_vllm_0_33_0s_on_each_cuda_arch(arch, recorded_tk, monkeypatch):
    """The adapter's weight conversion on ARCH makes the calls vLLM 0.34.0's ``mxfp4_utils._swizzle_mxfp4``
    makes on a device of that capability (triton_kernels v3.5.1, torch >= 2.8.1): the same opt-flag
    constraints (split_k = 1 on Hopper; is_persistent with epilogue_subtile = 1 on SM10x and SM12x),
    the same layouts and options (Hopper's, else Blackwell's, which SM12x gets too), on the same
    tensors (Hopper's scale groups padded to a multiple of 4). sm90 included: it must stay as it was."""
    from mxmoe.kernels import oai_triton

    tk = recorded_tk
    tk.cap = _CUDA_CAPS[arch]
    fail = lambda: pytest.fail("a ROCm-only helper was called on CUDA")  # noqa: E731
    ns = _vllm_defs(
        _VLLM_MXFP4_UTILS,
        ("should_use_gfx1250_mx_scale_swizzle", "_swizzle_mxfp4"),
        {
            "Any": object, "torch": torch, "current_platform": _FakeCuda(tk.cap), "logger": None,
            "has_triton_kernels": lambda: True, "get_triton_kernels_version": lambda: "3.5.1",
            "is_torch_equal_or_newer": lambda v: True, "should_use_cdna4_mx_scale_swizzle": fail,
        },
    )  # fmt: skip
    inputs = make_inputs(make_case("gptoss20b", 1, tp=4), "cpu")  # H/32 = 90 scale groups: Hopper pads them
    backend = OaiTriton()
    backend._tk = tk
    t = backend.convert_weights(inputs).tensors
    got, want = [], []
    monkeypatch.setattr(oai_triton, "host_arch", lambda: arch)
    for role in ("w13", "w2"):
        tk.constraints, tk.conversions = [], []
        backend._swizzle(t[f"{role}_blocks"], t[f"{role}_scales"], inputs.case)
        got.append((tk.constraints, tk.conversions))
        tk.constraints, tk.conversions = [], []
        # vLLM's checkpoint memory: [E, N, K/2] blocks and [E, N, K/32] scales
        ns["_swizzle_mxfp4"](t[f"{role}_blocks"].transpose(-2, -1), t[f"{role}_scales"].transpose(-2, -1))
        want.append((tk.constraints, tk.conversions))
    for (gc, gconv), (wc, wconv) in zip(got, want):
        assert gc == wc and gc == [oai_triton.swizzle_constraints(arch)]
        assert [c[1:] for c in gconv] == [c[1:] for c in wconv]  # shape, dtype, layout, options
        assert all(torch.equal(g[0], w[0]) and g[0].stride() == w[0].stride() for g, w in zip(gconv, wconv))
    blackwell = (tk.layout.BlackwellMXValueLayout, tk.layout.BlackwellMXScaleLayout)
    hopper = (tk.layout.HopperMXValueLayout, tk.layout.HopperMXScaleLayout)
    assert tuple(c[3] for c in got[0][1]) == (hopper if arch == "sm90" else blackwell)


@_needs_vllm_and_tk
@pytest.mark.parametrize("arch", sorted(_CUDA_CAPS))
def test_block_m_per_call_is_vllm_0_33_0s_on_each_cuda_arch(arch, recorded_tk):
    """``call_constraints`` against vLLM 0.34.0's ``_constrain_sm12x_block_m`` (with its ``_is_sm12x``,
    ``_sm12x_block_m`` and ``_SM12X_MAX_BLOCK_M``) on a device of ARCH's capability: block_m pinned
    on SM12x only (sm120, sm121), nothing on sm90 or sm100, for decode to prefill row counts."""
    import functools

    import triton

    from mxmoe.kernels.oai_triton import SM12X_MAX_BLOCK_M, call_constraints

    tk = recorded_tk
    ns = _vllm_defs(
        _VLLM_TRITON_MOE,
        ("_is_sm12x", "_SM12X_MAX_BLOCK_M", "_sm12x_block_m", "_constrain_sm12x_block_m"),
        {"functools": functools, "triton": triton, "current_platform": _FakeCuda(_CUDA_CAPS[arch])},
    )
    assert ns["_SM12X_MAX_BLOCK_M"] == SM12X_MAX_BLOCK_M
    for rows in (1, 2, 4, 7, 16, 31, 32, 33, 64, 100, 128, 255, 256, 1000, 4096, 8192, 65536):
        for experts in (1, 3, 4, 8, 32, 128):
            tk.constraints = []
            ns["_constrain_sm12x_block_m"](rows, experts)
            want = tk.constraints[0] if tk.constraints else {}
            assert len(tk.constraints) <= 1 and call_constraints(arch, rows, experts) == want, (rows, experts)
    assert bool(call_constraints(arch, 64, 4)) == arch.startswith("sm12")


@pytest.mark.skipif(not _vllm_source(_VLLM_TRITON_MOE).is_file(), reason="vLLM 0.34.0's sources are not fetched")
def test_vllm_pins_block_m_before_the_first_matmul_of_both_triton_paths():
    """Where vLLM 0.34.0 calls ``_constrain_sm12x_block_m``: with (M * topk, E), before the first
    ``matmul_ogs`` of ``triton_kernel_fused_experts`` (TRITON, both kernel classes) and of
    ``UnfusedOAITritonExperts.apply`` (TRITON_UNFUSED), M the tokens and E the local experts
    (``E, _, N = w1.shape``). The adapters call ``constrain_call`` at the same point (next test)."""
    import ast

    tree = ast.parse(_vllm_source(_VLLM_TRITON_MOE).read_text())
    funcs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    unfused = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "UnfusedOAITritonExperts")
    where = {
        "triton_kernel_fused_experts": funcs["triton_kernel_fused_experts"],
        "UnfusedOAITritonExperts.apply": next(n for n in unfused.body if getattr(n, "name", "") == "apply"),
    }
    calls = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "_constrain_sm12x_block_m"
    ]
    assert len(calls) == len(where)
    for fn in where.values():
        body = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
        pins = [n for n in body if getattr(n.func, "id", "") == "_constrain_sm12x_block_m"]
        first_matmul = min(n.lineno for n in body if getattr(n.func, "id", "") == "matmul_ogs")
        assert len(pins) == 1 and [ast.unparse(a) for a in pins[0].args] == ["M * topk", "E"]
        assert pins[0].lineno < first_matmul
        assert "E, _, N = w1.shape" in ast.unparse(fn)


class _FirstMatmul(Exception):
    pass


@pytest.mark.parametrize("tactic", [None, "splitk2", "bm64"])
@pytest.mark.parametrize("arch", ["sm90", "sm100", "sm120", "gfx950"])
@pytest.mark.parametrize("adapter", [OaiTriton, OaiTritonUnfused], ids=lambda c: c.declaration.id)
def test_adapters_pin_block_m_before_their_first_matmul_on_sm12x_only(adapter, arch, tactic, monkeypatch):
    """On the host's arch, read at run time: at GEMM1, the constraints ``swizzle_constraints`` and
    ``call_constraints`` give for tokens x top-k rows over the local experts (block_m on SM12x
    only), with a forced tactic's settings over them; afterwards triton_kernels' module-wide
    constraints are as they were (a tactic must not leak into vLLM's own layer, which reads the
    same dict). triton_kernels is faked: this checks the calls only."""
    from types import SimpleNamespace

    from mxmoe.kernels import oai_triton
    from mxmoe.kernels.oai_triton import Prepared, call_constraints, swizzle_constraints

    monkeypatch.setattr(oai_triton, "host_arch", lambda: arch)
    case = make_case("tiny", 7)
    inputs = make_inputs(case, "cpu")
    tokens, experts, seen = inputs.x.shape[0], 8, {}
    flags = SimpleNamespace(_opt_flags_constraints={"num_stages": 3})
    flags.update_opt_flags_constraints = lambda c: flags._opt_flags_constraints.update(c)
    flags.reset_opt_flags_constraints = lambda: setattr(flags, "_opt_flags_constraints", {})

    def matmul_ogs(*args, **kwargs):
        seen["constraints"] = dict(flags._opt_flags_constraints)
        raise _FirstMatmul

    mo = SimpleNamespace(matmul_ogs=matmul_ogs, FusedActivation=lambda *a: None, FnSpecs=lambda *a: None)
    tk = SimpleNamespace(matmul_ogs=mo, swiglu=SimpleNamespace(swiglu_fn=None), opt_flags=flags)
    w13 = torch.zeros(experts, 8, 16)
    prepared = Prepared(w13, None, None, None, None, None, hidden=8, experts=experts, tk=tk)
    x = torch.zeros(tokens, 8, dtype=torch.bfloat16)
    monkeypatch.setattr(adapter, "begin", lambda self, p, i: (None, None, None, None, x))
    backend = adapter()
    if tactic:
        backend.with_tactic(tactic)
        assert backend.declaration.id == f"{adapter.declaration.id}-tactic-{tactic}"
    with pytest.raises(_FirstMatmul):
        backend.run(prepared, inputs, torch.empty(tokens, 8, dtype=torch.bfloat16))
    want = call_constraints(arch, tokens * case.top_k, experts)
    forced = backend.tactic.as_dict() if tactic else {}
    assert seen["constraints"] == {"num_stages": 3, **swizzle_constraints(arch), **want, **forced}
    assert bool(want) == (arch == "sm120")
    assert flags._opt_flags_constraints == {"num_stages": 3}


def test_a_tactic_is_a_backend_of_its_own_and_unknown_ones_are_refused():
    """``with_tactics``: default adds nothing, ``all`` every declared tactic after its backend,
    names only those; the spec carries the tactic into a worker process; an unknown name is an
    error listing the declared ones."""
    from mxmoe.harness.run.registry import load_spec, with_tactics

    base = [load_spec("mxmoe.kernels.oai_triton:OaiTriton"), load_spec("mxmoe.kernels.emulation:Emulation")]
    assert with_tactics(base) == base
    every = with_tactics(base, "all")
    ids = [item.backend.declaration.id for item in every]
    assert ids[0] == "triton" and ids[-1] == base[1].backend.declaration.id
    assert ids[1:-1] == [f"triton-tactic-{t.name}" for t in OaiTriton.declaration.tactics]
    again = load_spec(every[1].spec)
    assert again.backend.declaration.id == ids[1] and again.backend.tactic == every[1].backend.tactic
    assert [i.backend.declaration.id for i in with_tactics(base, "splitk2")][1] == "triton-tactic-splitk2"
    with pytest.raises(ValueError, match="bm16"):
        with_tactics(base, "nosuch")
    assert "sm120" not in load_spec("mxmoe.kernels.oai_triton:OaiTriton#tactic=bm64").backend.declaration.archs
    assert type(load_spec("mxmoe.kernels.oai_triton:OaiTriton#tactic=nosuch").backend).__name__ == "BrokenBackend"


def test_vllms_layer_declares_no_tactic_it_does_not_force():
    """vLLM's layer runs its kernel's own pick: no ``vllm-<id>-tactic-<name>`` exists to claim a
    configuration that was not forced (the direct adapters force each, on the same kernel source).
    ``--tactics all`` adds none after it, and a tactic named for it alone is refused."""
    from mxmoe.harness.run.registry import load_spec, with_tactics
    from mxmoe.kernels.vllm_layer import DRIVEN

    assert [c.declaration.id for c in DRIVEN if c.declaration.tactics] == []
    assert OaiTriton.declaration.tactics and OaiTritonUnfused.declaration.tactics
    driven = [load_spec("mxmoe.kernels.vllm_layer:VllmTriton"), load_spec("mxmoe.kernels.vllm_layer:VllmTritonUnfused")]
    assert with_tactics(driven, "all") == driven
    with pytest.raises(ValueError, match="none"):
        with_tactics(driven, "bm64")
    assert type(load_spec("mxmoe.kernels.vllm_layer:VllmTriton#tactic=bm64").backend).__name__ == "BrokenBackend"


def test_the_vllm_driver_declines_a_biasless_case_that_vllms_conversion_refuses_naming_vllms_check(tmp_path):
    """vLLM's GPT-OSS method always has biases, and its FlashInfer conversions assert so; the driver
    turns that assertion, for a case without biases only, into a decline naming vLLM's own check."""
    from mxmoe.kernels.vllm_layer import _refused_without_bias

    source = tmp_path / "mxfp4.py"
    source.write_text("def convert(w13_bias, w2_bias):\n    assert w13_bias is not None and w2_bias is not None\n")
    namespace: dict = {}
    exec(compile(source.read_text(), str(source), "exec"), namespace)
    with pytest.raises(AssertionError) as exc:
        namespace["convert"](None, None)
    assert _refused_without_bias("FLASHINFER_CUTLASS_MXFP4_BF16", exc.value) == (
        "vLLM's FLASHINFER_CUTLASS_MXFP4_BF16 weight conversion refuses a layer without biases (mxfp4.py:2 "
        "`assert w13_bias is not None and w2_bias is not None`); GPT-OSS checkpoints always have them, so vLLM "
        "never sends this case"
    )


VLLM_NEEDS_BIASES = (
    "vllm-flashinfer-cutlass-mxfp4-bf16",
    "vllm-flashinfer-cutlass-mxfp4-mxfp8",
    "vllm-flashinfer-trtllm-mxfp4-bf16",
    "vllm-flashinfer-trtllm-mxfp4-mxfp8",
)
"""vLLM's layers whose conversion asserts both biases in 0.26.0, 0.33.0 and 0.34.0 (``vllm-drift``'s
``needs_biases``, run on vLLM's sources)."""


def test_vllms_layer_declares_no_case_without_biases_where_vllms_conversion_asserts_them():
    """On an H100 (2026-12-07) a kernel check requiring vllm-flashinfer-cutlass-mxfp4-bf16 was
    BLOCKED on coverage: it "ran 33 of the 34 pr cases it declares", the 34th the case without
    biases, where vLLM's conversion asserted both biases at run time. The declaration now says so:
    the case is a SKIP decided before any load, and not among the cases a required backend owes.
    The FlashInfer kernels themselves take a layer without biases: their direct adapters keep it."""
    from mxmoe.reports.build import _expected_cases

    by_id = {i.backend.declaration.id: i.backend for i in LOADED}
    case = make_case("tiny", 8, bias=False)
    assert case.id == "tiny-interleaved-nobias-t8"
    for ident in VLLM_NEEDS_BIASES:
        backend, arch = by_id[ident], by_id[ident].declaration.archs[0]
        assert backend.supports(case, arch) == (
            f"{ident}: vLLM's {backend.vllm_backend} weight conversion asserts both biases "
            "(convert_gpt_oss_weight_to_mxfp4_moe_kernel_format); GPT-OSS checkpoints always have them, so vLLM "
            "never sends a layer without"
        )
        assert backend.supports(make_case("tiny", 8), arch) is None
        direct = by_id[ident.removeprefix("vllm-")]
        assert direct.declaration.vllm_needs_biases and direct.supports(case, arch) is None
        expected = _expected_cases(backend, arch, "pr")
        assert expected and not any("-nobias-" in t for t in expected)
    needs = {i for i, b in by_id.items() if i.startswith("vllm-") and b.declaration.vllm_needs_biases}
    assert needs == set(VLLM_NEEDS_BIASES)
    for ident in ("vllm-emulation", "marlin"):  # vLLM's conversion takes their layers without biases
        assert by_id[ident].supports(case, "sm90") is None
    assert by_id["flashinfer-cutlass-mxfp4-bf16-old-layout"].declaration.vllm_needs_biases is False


VLLM_ROUTING = ("Default", "Renormalize", "DeepSeekV3", "Llama4", "RenormalizeNaive", "TopK", "SigmoidRenorm",
                       "MiniMax2", "Sigmoid", "Unspecified", "DeepseekV4", "Custom", "Simulated")  # fmt: skip
"""vLLM 0.34.0's ``RoutingMethodType`` members, in its order (``fused_moe/config.py``; 0.33.0's are the
same): no TopKSigmoid."""


def _fake_vllm(monkeypatch: pytest.MonkeyPatch, version: str, members: tuple[str, ...]) -> None:
    """Just enough of a vLLM package for the driver to ask for its routing enum (CPU, no vLLM)."""
    import enum
    import types

    names = ("vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.fused_moe")
    modules = [types.ModuleType(n) for n in (*names, f"{names[-1]}.config")]
    modules[0].__version__ = version
    modules[-1].RoutingMethodType = enum.IntEnum("RoutingMethodType", members)
    for parent, child in zip(modules, modules[1:]):
        setattr(parent, child.__name__.rsplit(".", 1)[1], child)
    for m in modules:
        monkeypatch.setitem(sys.modules, m.__name__, m)


def test_the_vllm_driver_maps_every_routing_method_by_name():
    """vLLM names its members as the harness names its routing methods: every one but TopKSigmoid
    is a member of vLLM 0.34.0's enum (NEWEST_VLLM's, read from its fetched sources where they are here)."""
    import ast

    from mxmoe.reference.routing import ROUTING_METHODS

    assert set(ROUTING_METHODS) - set(VLLM_ROUTING) == {"TopKSigmoid"}
    source = _vllm_source("vllm/model_executor/layers/fused_moe/config.py")
    if source.is_file():
        tree = ast.parse(source.read_text())
        enum_class = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "RoutingMethodType")
        members = tuple(t.id for n in enum_class.body if isinstance(n, ast.Assign) for t in n.targets)
        assert members == VLLM_ROUTING


def test_the_vllm_driver_names_vllms_member_or_declines_a_routing_vllm_lacks():
    import enum

    from mxmoe.kernels.vllm_layer import vllm_routing_method

    old = enum.IntEnum("RoutingMethodType", VLLM_ROUTING)
    assert vllm_routing_method("Sigmoid", old, NEWEST_VLLM) is old.Sigmoid
    with pytest.raises(BackendUnavailable) as declined:
        vllm_routing_method("TopKSigmoid", old, NEWEST_VLLM)
    assert str(declined.value) == (
        f"vLLM {NEWEST_VLLM}'s RoutingMethodType has no TopKSigmoid member (it has {', '.join(VLLM_ROUTING)}), "
        "so vLLM's layer cannot express routing method TopKSigmoid"
    )
    later = enum.IntEnum("RoutingMethodType", (*VLLM_ROUTING, "TopKSigmoid"))  # a release that has it
    assert vllm_routing_method("TopKSigmoid", later, "9.9.9") is later.TopKSigmoid
    with pytest.raises(ValueError, match="routing must be one of Default, .*; got 'Softmax'"):
        vllm_routing_method("Softmax", old, NEWEST_VLLM)


@pytest.mark.parametrize("driver", ["marlin", "vllm-emulation", "vllm-flashinfer-cutlass-mxfp4-bf16"])
def test_a_routing_vllm_lacks_is_a_skip_naming_it_never_an_error(driver, monkeypatch):
    """The H200 nightly's ERROR (KeyError: 'TopKSigmoid' in convert) on every
    small-interleaved-topksigmoid case, for the three vLLM layer backends that declare every routing:
    the driver now declines such a case in convert, a SKIP naming vLLM's release and its members."""
    _fake_vllm(monkeypatch, NEWEST_VLLM, VLLM_ROUTING)
    cls = next(i.backend for i in LOADED if i.backend.declaration.id == driver).__class__
    arch = "sm90"  # declared by all three, and the driver's decline is the same on every arch:
    monkeypatch.setattr("mxmoe.harness.judge.engine.host_arch", lambda: arch)  # this host stands for one
    monkeypatch.setattr(cls, "load", lambda self: None)  # vLLM is faked: nothing to boot
    case = make_case("small", 3, routing="TopKSigmoid")
    assert case.id == "small-interleaved-topksigmoid-t3"
    result, _ = run_case(cls(), case, arch, inputs=make_inputs(case, "cpu"))
    assert (result.outcome, result.traceback) == ("SKIP", ""), result.traceback
    assert result.reason == (
        f"{driver} cannot run this case: vLLM {NEWEST_VLLM}'s RoutingMethodType has no TopKSigmoid member (it has "
        f"{', '.join(VLLM_ROUTING)}), so vLLM's layer cannot express routing method TopKSigmoid"
    )


def test_triton_unfused_cross_tool_layouts() -> None:
    """The standalone cross tool's torch side, on any host: the layouts it names are the project's,
    and the adapter's activation on [gate; up] rows equals it on the same rows interleaved, bit for
    bit, where the oracle's order may differ only by rounding. A misspelt layout there once crashed
    the tool on the H200 after vLLM's GEMMs had run, so only a GPU would have found it."""
    tool = runpy.run_path(str(ROOT / "tools" / "triton_unfused_cross.py"))
    n = 32
    gen = torch.Generator().manual_seed(0)
    chunked = (torch.randn(64, 2 * n, generator=gen) * 4).to(torch.bfloat16)
    interleaved = torch.stack([chunked[:, :n], chunked[:, n:]], dim=-1).reshape(64, 2 * n)
    adapter = tool["adapter_activation"](chunked, tool["ADAPTER_LAYOUT"])
    vllm_rows = tool["adapter_activation"](interleaved, tool["VLLM_LAYOUT"])
    assert torch.equal(adapter.view(torch.int16), vllm_rows.view(torch.int16))
    oracle = tool["oracle_order"](interleaved, tool["VLLM_LAYOUT"]).float()
    assert torch.allclose(oracle, adapter.float(), rtol=2**-7, atol=2**-20)


@pytest.mark.parametrize("asked", [None, "0.33.0"])
def test_the_vllm_driver_boots_the_driven_release_and_its_build_names_it(asked, monkeypatch):
    """``load`` boots ``driven_release()`` (NEWEST_VLLM, or $MXMOE_VLLM_VERSION) and every result's
    build names the vLLM release that was imported and the release whose sources the ops were built
    from: a verdict is never read as another release's."""
    from mxmoe.harness.upstream import vllm_runtime
    from mxmoe.harness.upstream.fetch import PREVIOUS_VLLM

    if asked is None:
        monkeypatch.delenv("MXMOE_VLLM_VERSION", raising=False)
    else:
        monkeypatch.setenv("MXMOE_VLLM_VERSION", asked)
    want = asked or NEWEST_VLLM
    assert vllm_runtime.driven_release() == want and PREVIOUS_VLLM == "0.33.0"
    booted = []
    ops = {"hash": "69c99985f5281723", "recipe": {"vllm": want, "ops": ["_C::gptq_marlin_repack"], "torch": "2.11.0",
                                                  "nvcc": "13.0"}}  # fmt: skip

    def boot(version, arch):
        booted.append((version, arch))
        return {"vllm": version, "source": f"runtime .cache/vllm-runtime-{version}-py3.12", "stubs": [], "ops": ops}

    monkeypatch.setattr(vllm_runtime, "boot", boot)
    monkeypatch.setattr("mxmoe.harness.contract.platforms.host_arch", lambda: "sm90")
    monkeypatch.setattr(VendorKernel, "load", lambda self: None)  # the vendor import: no vLLM here
    cls = next(i.backend for i in LOADED if i.backend.declaration.id == "marlin").__class__
    driver = cls()
    driver.load()
    assert booted == [(want, "sm90")]
    assert driver.provenance() == (
        f"vllm {want} (runtime .cache/vllm-runtime-{want}-py3.12); compiled ops from the project's build "
        f"69c99985f5281723 of vLLM {want}'s sources (_C::gptq_marlin_repack; torch 2.11.0, CUDA 13.0)"
    )
