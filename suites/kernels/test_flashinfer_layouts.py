"""The project's FlashInfer storage steps against FlashInfer's own layout code, on the same bytes,
with K > 128 (at K = 128 the old and new SM90 scale layouts coincide, which once hid a bug), for
three FlashInfer releases: the installed one (./dev installs 0.6.14 on GPU-less hosts), imported
here, and the two of ``CACHED_FLASHINFERS``, ``VLLM_PINNED_FLASHINFER`` (0.7.2, the release of
vLLM 0.33.0's pin) and ``NEWEST_FLASHINFER`` (0.7.4), which only ./dev's copies in
``.cache/vendor/flashinfer-<version>`` hold and which a subprocess each imports (one process
imports one flashinfer). All are given the same input bytes, made here.

For each release, the SM90 layout checked is the generation the adapter picks for that version
(``sm90_generation``): its scale step against FlashInfer's pure-torch
``interleave_moe_scales_for_sm90_mixed_gemm``, and its weight step against the CUDA kernel behind
``interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")`` (quant type 1 ->
``interleave_fp4_weights_for_sm90_mixed_gemm`` in ``moe_gemm_mixed_utils.cu``, which the wheel
ships as source), compiled for the CPU with the host's C++ compiler and run thread by thread,
expert by expert as FlashInfer's binding launches it. The TRT-LLM-gen (sm100) row shuffles are
checked against ``get_w2_permute_indices_with_cache`` (what vLLM uses for every tensor) and
``_maybe_get_cached_w3_w1_permute_indices`` (FlashInfer's own MXFP4 preparation of w13)."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from mxmoe.harness.upstream.fetch import flashinfer_root
from mxmoe.kernels import storage
from mxmoe.kernels.flashinfer_common import (
    CACHED_FLASHINFERS,
    NEWEST_FLASHINFER,
    SM90_LAYOUTS,
    VLLM_PINNED_FLASHINFER,
    installed_version,
    sm90_generation,
)
from mxmoe.reference.activation import convert_layout

ROOT = Path(__file__).resolve().parents[2]
WEIGHT_KERNEL_SOURCE = "data/csrc/nv_internal/tensorrt_llm/kernels/cutlass_kernels/moe_gemm/moe_gemm_mixed_utils.cu"
"""Where a flashinfer-python wheel keeps the SM90 weight interleave kernel, from the package folder."""
EPILOGUE_TILE_M = 128
INSTALLED = "installed"
CACHED_ROLES = {VLLM_PINNED_FLASHINFER: "vllm-pinned", NEWEST_FLASHINFER: "newest"}
"""The test id's word for each cached release."""


def _bytes(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


SM90_SCALES = {  # [E, rows, K/32]; rows % 64 == 0 for the folded layout
    "K256": (3, 256, 8),
    "gptoss-w13-tp4-K2944": (2, 1536, 92),  # gpt-oss H = 2880 padded to 2944, 2I = 1536 at TP4
    "gptoss-w2-tp4-K768": (2, 2944, 24),
}
SM90_WEIGHTS = {  # [E, rows, K/2]; rows % 16 == 0, K % 64 == 0
    "K256": (2, 256, 128),
    "gptoss-w13-tp4-K2944": (2, 1536, 1472),
    "gptoss-w2-tp4-K768": (1, 2944, 384),
}
TRTLLM_ROWS = (256, 768, 2944)


def _cases() -> dict[str, tuple[str, torch.Tensor]]:
    """Every FlashInfer call the tests compare with: name -> (what, input)."""
    cases: dict[str, tuple[str, torch.Tensor]] = {}
    for i, (name, shape) in enumerate(SM90_SCALES.items()):
        cases[f"sm90-scales-{name}"] = ("sm90_scales", _bytes(*shape, seed=10 + i))
    for rows in TRTLLM_ROWS:
        cases[f"w2-rows-{rows}"] = ("w2_rows", _bytes(rows, 144, seed=rows))
        cases[f"w2-sf-rows-{rows}"] = ("w2_sf_rows", _bytes(rows, 96, seed=rows + 1))  # 96 groups: K = 3072
        cases[f"w2-bias-rows-{rows}"] = ("w2_rows", torch.zeros(rows, 1))  # vLLM permutes biases as [rows, 1]
        cases[f"w3-w1-rows-{rows}"] = ("w3_w1_rows", _bytes(rows, 144, seed=rows + 2))
        cases[f"w3-w1-sf-rows-{rows}"] = ("w3_w1_sf_rows", _bytes(rows, 96, seed=rows + 3))
    return cases


def flashinfer_outputs(cases: dict[str, tuple[str, torch.Tensor]]) -> dict[str, object]:
    """FlashInfer's pure-torch helpers on ``cases``, with the importable flashinfer (run in this
    process for the installed release and in a subprocess for each cached one). A helper the
    release does not have gives None."""
    import flashinfer
    import flashinfer.fused_moe as fused_moe
    from flashinfer.fused_moe import core

    calls = {  # what -> (module, function, keyword arguments after (cache, tensor, epilogue tile))
        "sm90_scales": (fused_moe, "interleave_moe_scales_for_sm90_mixed_gemm", None),
        "w2_rows": (core, "get_w2_permute_indices_with_cache", {}),
        "w2_sf_rows": (core, "get_w2_permute_indices_with_cache", {"num_elts_per_sf": 16}),
        "w3_w1_rows": (core, "_maybe_get_cached_w3_w1_permute_indices", {"is_gated_act_gemm": True}),
        "w3_w1_sf_rows": (
            core,
            "_maybe_get_cached_w3_w1_permute_indices",
            {"num_elts_per_sf": 16, "is_gated_act_gemm": True},
        ),
    }
    out: dict[str, object] = {"version": flashinfer.__version__, "file": flashinfer.__file__}
    for name, (what, t) in cases.items():
        module, fn, kwargs = calls[what]
        if not hasattr(module, fn):
            out[name] = None
        elif kwargs is None:
            out[name] = getattr(module, fn)(t.clone()).cpu()
        else:
            out[name] = getattr(module, fn)({}, t.clone(), EPILOGUE_TILE_M, **kwargs).cpu()
    return out


_SHIM = r"""
#include <cstddef>
#include <cstdint>
struct dim3 { unsigned x, y, z; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
typedef void* cudaStream_t;
static dim3 gridDim, blockDim, blockIdx, threadIdx;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
template <typename Kernel, typename... Args>
static void mxmoe_launch(dim3 grid, dim3 block, Kernel kernel, Args... args) {
  gridDim = grid;
  blockDim = block;
  for (unsigned b = 0; b < grid.x * grid.y * grid.z; ++b)
    for (unsigned t = 0; t < block.x * block.y * block.z; ++t) {
      blockIdx = dim3(b % grid.x, b / grid.x % grid.y, b / (grid.x * grid.y));
      threadIdx = dim3(t % block.x, t / block.x % block.y, t / (block.x * block.y));
      kernel(args...);
    }
}
"""
_ENTRY = r"""
extern "C" void mxmoe_interleave_fp4(uint8_t* src, uint8_t* dst, int rows, int cols) {
  tensorrt_llm::kernels::cutlass_kernels::interleave_fp4_weights_for_sm90_mixed_gemm(src, dst, rows, cols, nullptr);
}
"""
_LAUNCH = re.compile(r"(\w+)\s*<<<\s*([^,>]+?)\s*,\s*([^,>]+?)\s*(?:,[^>]*)?>>>\s*\(")


def compile_weight_kernel(source: Path, build: Path, compiler: str) -> Callable[[int, int, int, int], None]:
    """FlashInfer's ``moe_gemm_mixed_utils.cu`` as a CPU library: each ``kernel<<<grid, block, ...>>>``
    launch becomes a loop over every block and thread (the kernels share no memory and never
    synchronize, so one thread after another computes what the GPU does)."""
    text, launches = _LAUNCH.subn(r"mxmoe_launch(\2, \3, \1, ", source.read_text())
    assert launches, f"no kernel launch found in {source}"
    text = text.replace('#include "moe_gemm_mixed_utils.h"', "")
    cpp, lib = build / "moe_gemm_mixed_utils.cpp", build / "moe_gemm_mixed_utils.so"
    cpp.write_text(_SHIM + text + _ENTRY)
    proc = subprocess.run(
        [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-w", "-o", str(lib), str(cpp)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"{source} did not compile for the CPU:\n{proc.stderr[-4000:]}"
    fn = ctypes.CDLL(str(lib)).mxmoe_interleave_fp4
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int], None
    return fn


@dataclass
class Release:
    """One FlashInfer release under test: its version, package folder and helpers' outputs."""

    version: str
    package: Path
    outputs: dict[str, object]
    build: Path
    kernel: Callable[[int, int, int, int], None] | None = None

    @property
    def generation(self) -> str:
        return sm90_generation(self.version)

    def step(self, role: str) -> storage.Storage | None:
        """The storage step for ``role`` of the SM90 generation the adapter picks for this release."""
        found = [s for s in SM90_LAYOUTS[self.generation] if role in s.roles]
        return found[0] if found else None

    def output(self, name: str) -> torch.Tensor:
        got = self.outputs[name]
        if got is None:
            pytest.skip(f"flashinfer {self.version} has no helper for {name} (see flashinfer_outputs)")
        return got

    def weight_kernel(self) -> Callable[[int, int, int, int], None]:
        source = self.package / WEIGHT_KERNEL_SOURCE
        if self.step("w13_blocks") is None:
            pytest.skip(f"flashinfer {self.version} reads SM90 weights as they are (generation {self.generation})")
        assert source.is_file(), (
            f"flashinfer {self.version} reads generation {self.generation}'s weight layout but its package has no "
            f"{WEIGHT_KERNEL_SOURCE}: find where its SM90 weight interleave went"
        )
        compiler = next(filter(None, map(shutil.which, (os.environ.get("CXX") or "c++", "g++", "clang++"))), None)
        if not compiler:
            pytest.skip(
                "no C++ compiler (c++, g++, clang++ or $CXX) to run FlashInfer's SM90 weight interleave kernel "
                "on the CPU"
            )
        if self.kernel is None:
            self.kernel = compile_weight_kernel(source, self.build, compiler)
        return self.kernel


def _run_cached(version: str, cases_file: Path, out_file: Path) -> None:
    root = flashinfer_root(version)
    if not (root / "flashinfer" / "__init__.py").is_file():
        pytest.skip(
            f"flashinfer-python {version} is not in {root}: `./dev test` fetches it on hosts without a GPU, or run "
            "`python -m harness fetch flashinfer`"
        )
    cmd = [sys.executable, __file__, str(root), version, str(cases_file), str(out_file)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, f"flashinfer {version}'s helpers failed in a subprocess:\n{proc.stderr[-4000:]}"


@pytest.fixture(
    scope="module",
    params=[INSTALLED, *CACHED_FLASHINFERS],
    ids=[f"installed-{installed_version()}", *(f"{CACHED_ROLES[v]}-{v}" for v in CACHED_FLASHINFERS)],
)
def release(request, tmp_path_factory) -> Release:
    cases = _cases()
    tmp = tmp_path_factory.mktemp(f"flashinfer-{request.param}")
    if request.param == INSTALLED:
        pytest.importorskip(
            "flashinfer.fused_moe",
            reason="flashinfer-python is not installed (./dev installs 0.6.14 without its CUDA dependencies on hosts "
            "without a GPU)",
        )
        outputs = flashinfer_outputs(cases)
        assert outputs["version"] == installed_version()
    else:
        torch.save(cases, tmp / "cases.pt")
        _run_cached(request.param, tmp / "cases.pt", tmp / "outputs.pt")
        outputs = torch.load(tmp / "outputs.pt")
        assert outputs["version"] == request.param, outputs["version"]
        assert Path(outputs["file"]).resolve().is_relative_to(flashinfer_root(request.param).resolve()), outputs["file"]
    return Release(outputs["version"], Path(outputs["file"]).parent, outputs, tmp)


@pytest.mark.parametrize("name", sorted(SM90_SCALES))
def test_sm90_scales_match_flashinfer(release, name):
    """The scale step of the generation the adapter picks for this release (0.6.14: the
    [E, K/128, 4R] interleave; 0.7.2 and 0.7.4: the [E, R/64, K/128, 16, 16] fold) against
    FlashInfer's."""
    s = _cases()[f"sm90-scales-{name}"][1]
    theirs = release.output(f"sm90-scales-{name}")
    ours = release.step("w13_scales").forward(s, "w13_scales")
    assert theirs.shape == ours.shape, (release.version, release.generation, theirs.shape, ours.shape)
    assert torch.equal(theirs, ours), (release.version, release.generation)


@pytest.mark.parametrize("name", sorted(SM90_WEIGHTS))
def test_sm90_weights_match_flashinfer_kernel(release, name):
    """The weight step of the generation the adapter picks for this release (0.6.14: the nibble
    interleave of rows r, r + 8; 0.7.2 and 0.7.4: the bit-level repack) against FlashInfer's CUDA
    kernel, compiled from the release's own source."""
    kernel = release.weight_kernel()
    i = sorted(SM90_WEIGHTS).index(name)
    w = _bytes(*SM90_WEIGHTS[name], seed=20 + i)
    e, rows, kb = w.shape
    theirs = torch.full_like(w, 0x5A)  # bytes the kernel would not write stay visible
    for x in range(e):  # the binding's loop: one launch per expert, rows = n, cols = K
        kernel(w[x].data_ptr(), theirs[x].data_ptr(), rows, 2 * kb)
    ours = release.step("w13_blocks").forward(w, "w13_blocks")
    assert torch.equal(theirs, ours), (release.version, release.generation)


@pytest.mark.parametrize("rows", TRTLLM_ROWS)
def test_trtllm_epilogue_row_shuffle_matches_flashinfer_sm100(release, rows):
    """w13 (after vLLM's pair swap), w2, their scales and biases: FlashInfer's w2 permutation."""
    for kind in ("w2-rows", "w2-sf-rows", "w2-bias-rows"):
        theirs = release.output(f"{kind}-{rows}")
        assert torch.equal(theirs.long(), storage.epilogue_tile_rows(rows)), (release.version, kind)


@pytest.mark.parametrize("rows", TRTLLM_ROWS)
def test_trtllm_w13_pair_swap_and_shuffle_match_flashinfer_sm100(release, rows):
    """FlashInfer's own w13 preparation ([up; gate] rows reordered for the gated activation, then
    shuffled) is the project's chunked [up; gate] -> pair-swapped conversion, then its row shuffle."""
    chunked = torch.arange(rows)
    ours = convert_layout(chunked, "chunked_up_gate", "pair_swapped", dim=0)[storage.epilogue_tile_rows(rows)]
    for kind in ("w3-w1-rows", "w3-w1-sf-rows"):
        theirs = release.output(f"{kind}-{rows}")
        assert torch.equal(theirs.long(), ours), (release.version, kind)


def test_dev_test_prefetches_the_releases_these_tests_read():
    """``./dev test`` prefetches ``fetch flashinfer``, and that command's default releases land where
    these tests look for the cached ones (a set-up that fetched others would make them skip)."""
    from mxmoe.harness.cli.app import build_parser
    from mxmoe.harness.cli.fetch import flashinfer_versions

    dev = (ROOT / "dev").read_text()
    prefetch = dev[dev.index("prefetch() {"):]
    prefetch = prefetch[: prefetch.index("\n}\n")]
    assert "fetch_one flashinfer" in prefetch and 'harness fetch "$@" --if-missing' in dev
    args = build_parser().parse_args(["fetch", "flashinfer"])
    assert flashinfer_versions(args.flashinfer_version) == CACHED_FLASHINFERS
    assert len(set(CACHED_FLASHINFERS)) == len(CACHED_FLASHINFERS) == len(CACHED_ROLES)


if __name__ == "__main__":  # a cached release's side: python THIS_FILE PACKAGE_ROOT VERSION CASES OUT
    root, version, cases_file, out_file = sys.argv[1:]
    sys.path.insert(0, root)
    result = flashinfer_outputs(torch.load(cases_file))
    assert result["version"] == version, f"imported flashinfer {result['version']} from {result['file']}, not {version}"
    assert Path(str(result["file"])).resolve().is_relative_to(Path(root).resolve()), result["file"]
    torch.save(result, out_file)
