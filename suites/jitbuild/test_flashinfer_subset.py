"""The bf16 x MXFP4 subset of FlashInfer's SM90 CUTLASS MoE module: which of FlashInfer's own
sources it keeps (from FlashInfer's real ``fused_moe_90`` spec, on any host), that its binding
edits apply and keep the preprocessor balanced, that a module still needing a left-out symbol is
refused, and that a built module is installed in FlashInfer's place only for the FlashInfer that
built it. (The build itself needs nvcc and 16 cores for ~200 s: its numbers are in issue 16's
note; the GPU check of the kernel runs in ``check`` and the differential suite on sm90.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

fi = pytest.importorskip("flashinfer", reason="flashinfer-python is not installed (./dev installs it without a GPU)")

from mxmoe.harness.upstream import flashinfer_sm90 as fs  # noqa: E402

ANOTHER_RELEASE = "0.7.4" if fi.__version__ != "0.7.4" else "0.6.14"
"""A FlashInfer release other than the installed one (whichever that is)."""


@pytest.fixture
def subset(tmp_path, monkeypatch):
    """The subset as the installed FlashInfer's spec gives it for an sm90a target and CUDA 13.0
    (what the H200 has), built into ``tmp_path``: no nvcc or GPU is asked. CPU hosts have 0.6.14, a
    GPU host the release its vLLM pins (0.7.x): every test below holds for each generation."""
    from flashinfer.jit import core, cpp_ext
    from packaging.version import Version

    monkeypatch.setattr(cpp_ext, "get_cuda_version", lambda: Version("13.0"))
    monkeypatch.setattr(core.current_compilation_context, "TARGET_CUDA_ARCHS", {(9, "0a")})
    return fs.subset_spec(tmp_path)


def _weight(gen: fs.Generation) -> str:
    """MXFP4's spelling in a generation's generated kernel files (``__nv_fp4_e2m1``, ``SafeFP4``)."""
    return gen.launcher.split("<", 1)[1].split(",")[1].strip()


def test_subset_keeps_the_bf16_mxfp4_path_and_drops_the_other_types(subset, tmp_path):
    names = [s.name for s in subset.spec.sources]
    fp4 = _weight(subset.generation)
    assert subset.full_sources > 150 and subset.kept_sources < subset.full_sources // 5
    assert fs.KEPT_GEMM in names
    assert not [n for n in names if n.startswith(fs.GEMM_PREFIX) and n != fs.KEPT_GEMM]
    generated = [s for s in subset.spec.sources if s.name.endswith(".generated.cu")]
    # 10 of 154 generated files at 0.6.14, 23 of 220 at 0.7.x
    assert len(generated) == subset.generated_kept > 0 and subset.generated_full > 8 * subset.generated_kept
    every = sorted((tmp_path / "generated").rglob("*.generated.cu"))
    assert len(every) == subset.generated_full
    for s in every:  # kept: exactly the kernel files with a bf16 x e2m1 launcher (FlashInfer groups by
        # type, but a file may also hold a few fp16 x e2m1 ones: 4 of 80 launchers at 0.6.14)
        launchers = set(re.findall(r"sm90_generic_mixed_moe_gemm_kernelLauncher<([^,]+), ([^,]+),", s.read_text()))
        assert (("__nv_bfloat16", fp4) in launchers) == (s in generated), s.name
        if s in generated:
            assert {w for _, w in launchers} == {fp4}, s.name
    assert fs.INSTANTIATION_FILE not in names and "mxmoe_cutlass_fused_moe_instantiation.cu" in names
    # the rest of FlashInfer's spec is kept as it is: the DeepSeek block-scale runner each runner
    # constructs, the heuristics, the logging
    assert {"fp8_blockscale_gemm.cu", "cutlass_heuristic.cpp", "logger.cpp", "deepgemm_jit_setup.cu"} <= set(names)


def test_binding_edits_leave_one_runner_and_balanced_conditionals(subset):
    binding = next(s for s in subset.spec.sources if s.name == "flashinfer_cutlass_fused_moe_binding.cu")
    text = binding.read_text()
    start = text.index("#if 0  // mxmoe subset")
    end = text.index("#endif  // mxmoe subset")
    depth = 0
    for line in text[start:end].splitlines()[1:]:
        word = line.strip().split(" ")[0]
        depth += word in ("#if", "#ifdef", "#ifndef")
        depth -= word == "#endif"
        assert depth >= 0
    assert depth == 0
    live = re.sub(r"//[^\n]*", "", text[:start] + text[end:])
    made = set(re.findall(r"make_(?:shared|unique)<\s*kernels::CutlassMoeFCRunner<([^>]*)>", live))
    # switch_output_type's templated runners are never instantiated once its calls are cut
    runner = subset.generation.runner
    assert {r for r in made if "TypeAct" not in r} == {runner[runner.index("<") + 1 : -1]}
    assert "switch_output_type<" not in live.split("switch_output_type(DLDataType output_type)")[1]


def test_the_recipe_names_the_flashinfer_and_is_stable(subset, tmp_path, monkeypatch):
    again = fs.subset_spec(tmp_path)
    assert again.recipe == subset.recipe and len(subset.recipe) == 16


@pytest.mark.skipif(
    not (shutil.which("cc") and shutil.which("nm")), reason="needs a C compiler and nm to make a shared library"
)
def test_a_module_needing_a_left_out_symbol_is_named(tmp_path):
    src = tmp_path / "m.cpp"
    src.write_text(
        "namespace tensorrt_llm::kernels { void left_out(int); }\n"
        "void present(int x) { tensorrt_llm::kernels::left_out(x); }\n"
    )
    so = tmp_path / "m.so"
    subprocess.run(["c++", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    assert fs.undefined_left_out(so) == ["tensorrt_llm::kernels::left_out(int)"]
    src.write_text("void present(int) {}\n")
    subprocess.run(["c++", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    assert fs.undefined_left_out(so) == []


def _fake_build(root, version: str) -> None:
    so = fs.module_path(root)
    so.parent.mkdir(parents=True)
    so.write_bytes(b"")
    record = {"module": fs.SUBSET_NAME, "flashinfer": version, "recipe": "0" * 16, "cuda": "13.0"}
    (so.parent / "build.json").write_text(json.dumps(record))


def test_a_built_module_stands_in_for_flashinfers_only_for_its_flashinfer(tmp_path, monkeypatch):
    from flashinfer.fused_moe import core

    monkeypatch.setattr(core, "gen_cutlass_fused_moe_sm90_module", core.gen_cutlass_fused_moe_sm90_module)
    assert fs.install(tmp_path) is None
    _fake_build(tmp_path, "0.0.1")
    assert fs.install(tmp_path) is None and fs.built_record(tmp_path) is None
    shutil.rmtree(tmp_path / fs.SUBSET_NAME)
    _fake_build(tmp_path, fi.__version__)
    record = fs.install(tmp_path)
    assert record is not None and record["flashinfer"] == fi.__version__
    assert core.gen_cutlass_fused_moe_sm90_module().name == fs.SUBSET_NAME


def test_each_generation_is_read_from_the_release_and_one_matching_none_is_refused(subset):
    """The installed release's generation is the one that names it (0.6.14 on CPU hosts, 0.7.x on
    a GPU host); the other generation's spelling is checked on that release's own sources by
    suites/packaging/test_flashinfer_cut.py. A release whose binding or generated files spell the
    path otherwise is refused, naming what was looked for."""
    assert fi.__version__ in subset.generation.read_in.split(", ")
    assert fs.instantiation(subset.generation).count(f"CutlassMoeFCRunner<__nv_bfloat16, {subset.generation.weight}>")
    for gen in fs.GENERATIONS:
        assert fs.generation_of("x", f"      std::make_shared<{gen.runner}>();", [f"{gen.launcher} ..."]) == gen
    with pytest.raises(fs.BuildError, match=r"flashinfer 9\.9.s fused_moe_90 sources match none .*absent.*\(0 of 1\)"):
        fs.generation_of("9.9", "make_shared<kernels::CutlassMoeFCRunner<__nv_bfloat16, NewFp4>>", ["<bf16, NewFp4,"])


def test_builds_of_several_releases_lie_side_by_side_and_only_the_installed_ones_loads(tmp_path, monkeypatch):
    from flashinfer.fused_moe import core

    monkeypatch.setenv("MXMOE_CACHE", str(tmp_path))
    monkeypatch.setattr(core, "gen_cutlass_fused_moe_sm90_module", core.gen_cutlass_fused_moe_sm90_module)
    here = fs.build_root()
    assert here == tmp_path / "flashinfer-jit" / fi.__version__
    other = here.parent / ANOTHER_RELEASE
    _fake_build(other, ANOTHER_RELEASE)
    assert fs.install() is None  # the other release's build, in its own folder, is not this release's
    _fake_build(here, fi.__version__)
    assert fs.install()["flashinfer"] == fi.__version__ and fs.built_record(other) is None
    # a build.json that names another release, in this release's folder, is not loaded either
    (fs.module_path().parent / "build.json").write_text(json.dumps({"flashinfer": ANOTHER_RELEASE}))
    assert fs.built_record() is None


def test_a_release_the_subset_cannot_be_built_for_makes_the_backends_skip_naming_it(tmp_path, monkeypatch):
    from mxmoe.harness.contract.backend import BackendUnavailable
    from mxmoe.kernels import flashinfer_common

    monkeypatch.setenv("MXMOE_CACHE", str(tmp_path))
    monkeypatch.delenv(flashinfer_common.JIT_OPT_IN, raising=False)
    monkeypatch.setattr(flashinfer_common, "compiled_by_flashinfer", lambda name: False)

    def refused(*args, **kwargs):
        raise fs.BuildError("flashinfer 0.6.14's fused_moe_90 sources match none of the subset's generations (...)")

    monkeypatch.setattr(fs, "_build", refused)
    with pytest.raises(fs.BuildError):
        fs.build()
    assert fs.failed_record()["flashinfer"] == fi.__version__
    with pytest.raises(BackendUnavailable) as exc:
        flashinfer_common.require_compiled("fused_moe_90", "flashinfer-cutlass-mxfp4-bf16")
    said = str(exc.value)
    assert said.startswith(f"flashinfer-cutlass-mxfp4-bf16: the project's bf16 x MXFP4 subset of FlashInfer "
                           f"{fi.__version__}'s fused_moe_90 could not be built: flashinfer 0.6.14's fused_moe_90 "
                           "sources match none")  # fmt: skip
    # a build that succeeds clears the record
    monkeypatch.setattr(fs, "_build", lambda jobs, root: {"flashinfer": fi.__version__})
    fs.build()
    assert fs.failed_record() is None


def test_a_flashinfer_imported_from_elsewhere_than_the_installed_release_is_refused(monkeypatch):
    from mxmoe.harness.contract.backend import BackendUnavailable
    from mxmoe.kernels import flashinfer_common

    monkeypatch.setattr(fi, "__version__", ANOTHER_RELEASE)
    said = rf"the imported flashinfer is {re.escape(ANOTHER_RELEASE)} but flashinfer-python .* is "
    with pytest.raises(BackendUnavailable, match=said):
        flashinfer_common.require_compiled("fused_moe_90", "flashinfer-cutlass-mxfp4-bf16")


def test_the_build_string_names_the_flashinfer_release_first():
    from mxmoe.kernels.flashinfer_common import subset_build

    record = {"flashinfer": "0.7.4", "module": fs.SUBSET_NAME, "recipe": "0123456789abcdef", "cuda": "13.0"}
    assert subset_build(record).startswith("flashinfer-python 0.7.4, SM90 subset built by the project (")
