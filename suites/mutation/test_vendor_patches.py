"""Vendor mutation testing: the patches are well-formed data, apply exactly or fail naming the line,
apply to the vendor source where it is cached, and the interpreter fix they rely on on a CPU is
right. (The matrices themselves run where the kernels run: ``mutants --vendor triton`` on a GPU,
``mutants --vendor aiter`` under the interpreter; their numbers are in the issue's note.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mxmoe.harness.audits.mutation.patched import VENDORS, PatchError, apply, vendor
from mxmoe.harness.upstream.fetch import NEWEST_VLLM, VendorMissing
from mxmoe.harness.upstream.patches import (
    AITER_PATCHES,
    FLASHINFER_PATCHES,
    TRITON_PATCHES,
    VLLM_PATCHES,
    Edit,
    Patch,
    replace_line,
)


@pytest.mark.parametrize("patches", [TRITON_PATCHES, AITER_PATCHES], ids=["triton", "aiter"])
def test_each_vendor_has_eight_or_more_one_line_patches_across_the_kernel(patches):
    slugs = [p.slug for p in patches]
    assert len(slugs) == len(set(slugs)) >= 8
    assert {"activation", "bias", "routing-weight", "scale", "routing"} <= {p.category for p in patches}
    for p in patches:
        assert all(e.old != e.new and "\n" not in e.old + e.new for e in p.edits), p.slug
        assert len({e.file for e in p.edits}) == len(p.edits), f"{p.slug}: one line per file"


def test_patch_and_vendor_reject_unknown_names():
    with pytest.raises(ValueError, match="category must be one of"):
        Patch("x", "epilogue", "?", (Edit("a.py", "a", "b"),))
    with pytest.raises(ValueError, match="--vendor must be one of triton, aiter, vllm, flashinfer; got 'cutlass'"):
        vendor("cutlass")


def test_backend_picks_the_vendors_adapters_the_control_included(monkeypatch, tmp_path, capsys):
    """``mutants --vendor V --backend B`` runs the control and the patches through B alone (a patch
    of MARLIN's weight preparation need not run six other adapters); a name that is not V's adapter,
    or --backend without --vendor, is refused naming the accepted values. The header counts the
    patches that run (``--patch``), not every patch the vendor has."""
    from mxmoe.harness.audits.mutation import patched
    from mxmoe.harness.cli.app import main

    ran = []
    monkeypatch.setattr(patched, "run_vendor", lambda v, *a, **k: ran.append(v.backends) or [])
    out = str(tmp_path / "m.json")
    base = ["mutants", "--vendor", "vllm", "--case", "tiny-interleaved-t7", "--json", out]
    assert main([*base, "--backend", "marlin", "--patch", "marlin-w2-bias-unpermuted"]) == 0
    assert ran == [("marlin",)]
    assert "mutants --vendor vllm: 1 patches x adapters marlin on " in capsys.readouterr().out  # what runs
    with pytest.raises(SystemExit, match="2"):
        main([*base, "--backend", "cutlass"])
    accepted = ", ".join(vendor("vllm").backends)
    assert f"--backend must name adapters of vllm: {accepted}; got cutlass" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        main(["mutants", "--case", "tiny-interleaved-t7", "--backend", "marlin", "--json", out])
    assert "--backend names a vendor's patches or adapters: give --vendor too" in capsys.readouterr().err
    assert len(ran) == 1


def test_the_vllm_patches_are_one_line_edits_of_its_weight_preparation_run_by_its_layer_and_the_adapters():
    """vLLM's patches change its Python weight preparation, one line per file; the vendor runs them
    through vLLM's layer (``vllm-X``) and through the direct adapter of each same kernel (``X``),
    which must not see them."""
    v = VENDORS["vllm"]
    assert (v.package, v.patches) == ("vllm", VLLM_PATCHES)
    slugs = [p.slug for p in VLLM_PATCHES]
    assert len(slugs) == len(set(slugs)) >= 3
    for p in VLLM_PATCHES:
        assert p.edits and all(e.old != e.new and "\n" not in e.old + e.new for e in p.edits), p.slug
        assert all(e.file.startswith("model_executor/") and e.file.endswith(".py") for e in p.edits), p.slug
        assert len({e.file for e in p.edits}) == len(p.edits), f"{p.slug}: one line per file"
    drivers = {b for b in v.backends if b.startswith("vllm-")}
    assert drivers and {b.removeprefix("vllm-") for b in drivers} <= set(v.backends)


@pytest.mark.parametrize("name", sorted(VENDORS))
def test_every_vendor_runs_registered_backends(name):
    from mxmoe.harness.run.registry import discover

    registered = {item.backend.declaration.id for item in discover()}
    assert set(VENDORS[name].backends) <= registered, set(VENDORS[name].backends) - registered


FLASHINFER_WRITTEN_FOR = ("0.6.14", "0.7.2", "0.7.2.post1", "0.7.4")
"""The FlashInfer releases FLASHINFER_PATCHES are written against: the one ``./dev`` installs on a
host without a GPU, vLLM 0.33.0's pin and the newest (a GPU host installs the one its vLLM pins)."""


def test_every_flashinfer_patch_applies_to_each_release_it_is_written_for_and_runs_under_each_tactic():
    """Each edit's old line occurs once in the wrapper's call into the runner, and patching the
    file changes that line alone (as vLLM's are checked; copying the package per patch is the
    generic test's), in the installed FlashInfer and in each release ``./dev`` caches beside it
    (``CACHED_FLASHINFERS``); the vendor runs the direct adapter, whose declared tactics
    ``--tactics all`` adds as rows of their own."""
    from mxmoe.harness.upstream.fetch import flashinfer_root
    from mxmoe.kernels.flashinfer_common import CACHED_FLASHINFERS, installed_version
    from mxmoe.kernels.flashinfer_cutlass_mxfp4_bf16 import FlashInferCutlassMxfp4Bf16

    v = VENDORS["flashinfer"]
    assert (v.package, v.patches, v.backends) == ("flashinfer", FLASHINFER_PATCHES, ("flashinfer-cutlass-mxfp4-bf16",))
    assert len(FlashInferCutlassMxfp4Bf16.declaration.tactics) == 24
    packages = {installed_version(): v.locate()} if installed_version() in FLASHINFER_WRITTEN_FOR else {}
    for version in CACHED_FLASHINFERS:
        if (flashinfer_root(version) / "flashinfer" / "fused_moe" / "core.py").is_file():
            packages.setdefault(version, flashinfer_root(version) / "flashinfer")
    if not packages:
        cached = ", ".join(CACHED_FLASHINFERS)
        pytest.skip(f"no FlashInfer release the patches are written for is here (installed: {installed_version()}): "
                    f"./dev test installs 0.6.14 on a host without a GPU and caches {cached} "
                    "(python -m harness fetch flashinfer --flashinfer-version V)")  # fmt: skip
    for version, pkg in packages.items():
        assert version in FLASHINFER_WRITTEN_FOR, version
        _each_edit_changes_its_line_alone(pkg, FLASHINFER_PATCHES)


def test_a_vendor_that_runs_nowhere_here_says_each_reason_once():
    """With every tactic, one reason (the adapters are declared for sm90 only) stops 25 adapters;
    the error says it once, names three of them and counts the rest, and keeps a different reason
    apart."""
    from mxmoe.harness.audits.mutation.patched import none_runs

    ids = ["fi"] + [f"fi-tactic-t{i:02d}" for i in range(24)]
    records = [{"backend": b, "reason": f"{b} does not run on cpu (declared: sm90)"} for b in ids]
    records.append({"backend": "fi-other", "reason": "fi-other cannot run here: no module named flashinfer"})
    said = none_runs("flashinfer", records)
    assert said == ("no adapter of flashinfer runs a case on this host: fi, fi-tactic-t00, fi-tactic-t01 and 22 "
                    "more: it does not run on cpu (declared: sm90); fi-other: it cannot run here: no module named "
                    "flashinfer")  # fmt: skip


def _each_edit_changes_its_line_alone(pkg, patches) -> None:
    """Each edit of ``patches``, applied to its file under ``pkg``, changes its own line and no other."""
    for p in patches:
        for e in p.edits:
            text = (pkg / e.file).read_text()
            patched = replace_line(text, e, f"patch {p.slug}")
            changed = [(a, b) for a, b in zip(text.split("\n"), patched.split("\n")) if a != b]
            assert changed == [(e.old, e.new)], p.slug


VLLM_TESTED = NEWEST_VLLM
"""The vLLM release VLLM_PATCHES are written against: the one the runtime carries by default."""


def test_every_vllm_patch_applies_to_the_release_it_is_written_for():
    """Each edit's old line occurs exactly once in vLLM 0.34.0's own sources (``fetch vllm
    --vllm-version 0.34.0``, the drift check's copy), whatever the runtime at hand is."""
    from mxmoe.harness.upstream.vllm_drift import vllm_root

    pkg = vllm_root(VLLM_TESTED) / "vllm"
    if not (pkg / "__init__.py").is_file():
        pytest.skip(f"vLLM {VLLM_TESTED}'s sources are not fetched: python -m harness fetch vllm --vllm-version "
                    f"{VLLM_TESTED}")  # fmt: skip
    _each_edit_changes_its_line_alone(pkg, VLLM_PATCHES)


def _package(tmp_path: Path) -> Path:
    src = tmp_path / "src" / "pkg"
    (src / "sub").mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "sub" / "k.py").write_text("def f(x):\n    y = x + 1\n    return y\n")
    (src / "sub" / "twice.py").write_text("    a = 1\n    a = 1\n")
    (src / "sub" / "calls.py").write_text("g(\n    b,\n)\nrun(\n    b,\n)\n")
    return src


def test_apply_copies_then_changes_exactly_one_line(tmp_path):
    src = _package(tmp_path)
    patch = Patch("plus-two", "activation", "adds two", (Edit("sub/k.py", "    y = x + 1", "    y = x + 2"),))
    root = apply(src, tmp_path / "copy", "pkg", patch)
    assert (root / "pkg" / "sub" / "k.py").read_text() == "def f(x):\n    y = x + 2\n    return y\n"
    assert (src / "sub" / "k.py").read_text().count("x + 1") == 1  # the source is never touched
    assert (apply(src, tmp_path / "plain", "pkg", None) / "pkg" / "sub" / "k.py").read_text() == (
        src / "sub" / "k.py"
    ).read_text()


def test_an_anchored_edit_changes_the_first_line_after_its_anchor(tmp_path):
    """A line that occurs twice (an argument passed in two calls) is edited in the call after the
    anchor, the other left as it is."""
    src = _package(tmp_path)
    patch = Patch("b-dropped", "bias", "?", (Edit("sub/calls.py", "    b,", "    None,", "run("),))
    root = apply(src, tmp_path / "copy", "pkg", patch)
    assert (root / "pkg" / "sub" / "calls.py").read_text() == "g(\n    b,\n)\nrun(\n    None,\n)\n"
    with pytest.raises(PatchError, match="occurs 2 times in sub/calls.py"):
        apply(src, tmp_path / "plain", "pkg", Patch("p", "bias", "?", (Edit("sub/calls.py", "    b,", "    None,"),)))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (Edit("sub/k.py", "    y = x + 3", "    y = 0"), "occurs 0 times in sub/k.py"),
        (Edit("sub/twice.py", "    a = 1", "    a = 2"), "occurs 2 times in sub/twice.py"),
        (Edit("sub/gone.py", "x", "y"), "sub/gone.py is not in"),
        (Edit("sub/calls.py", "    b,", "    None,", "gone("), "anchor line 'gone\\(' occurs 0 times in sub/calls.py"),
        (Edit("sub/calls.py", "    c,", "    None,", "run("), "'c,' does not occur after 'run\\(' in sub/calls.py"),
    ],
)
def test_a_patch_that_does_not_apply_exactly_names_file_and_line(tmp_path, edit, message):
    with pytest.raises(PatchError, match=message):
        apply(_package(tmp_path), tmp_path / "copy", "pkg", Patch("p", "layout", "?", (edit,)))


@pytest.mark.parametrize("name", sorted(VENDORS))
def test_every_patch_applies_to_the_vendor_source_at_hand(name, tmp_path):
    v = VENDORS[name]
    try:
        src = v.locate()  # vLLM's: the runtime's, unpacked on first use (under unpack's lock)
    except VendorMissing as exc:
        pytest.skip(f"{name}'s source is not here: {exc}")
    for p in v.patches:
        root = apply(src, tmp_path / p.slug, v.package, p)
        for e in p.edits:
            assert e.new in (root / v.package / e.file).read_text().split("\n")


@pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the interpreter's bf16 cast is what is fixed: runs where Triton is interpreted",
)
def test_the_interpreter_rounds_float32_to_bfloat16_to_nearest_even(monkeypatch):
    import triton
    import triton.language as tl
    from triton.runtime import interpreter as ti

    from mxmoe.harness.audits.mutation.interpret import round_bf16_to_nearest

    for name in ("cast_impl", "create_fp_to_fp", "_mxmoe_rne_bf16"):  # undone after the test
        monkeypatch.setattr(ti.InterpreterBuilder, name, getattr(ti.InterpreterBuilder, name, False), raising=False)
    monkeypatch.delattr(ti.InterpreterBuilder, "_mxmoe_rne_bf16", raising=False)

    @triton.jit
    def cast(x_ptr, y_ptr, n: tl.constexpr):
        offs = tl.arange(0, n)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.bfloat16))

    x = torch.tensor([1 + 2**-8 + 2**-12, -(1 + 3 * 2**-8), 1 + 2**-8, 3.0e38, float("nan"), 0.1, -2.5e-3, 7.0])
    round_bf16_to_nearest()
    y = torch.empty(8, dtype=torch.bfloat16)
    cast[(1,)](x, y, 8)
    want = x.to(torch.bfloat16)  # torch rounds to nearest even
    assert torch.equal(y[~x.isnan()].view(torch.int16), want[~x.isnan()].view(torch.int16))
    assert bool(y[4].isnan())


def _rec(backend: str, case: str, outcome: str, digest: str, **kw: object) -> dict:
    rec = {"backend": backend, "case": case, "outcome": outcome, "reason": kw.pop("reason", outcome),
           "worst_ratio": 0.3, "over_bound": 0, "z": 1.0, "z_fired": False, "digest": digest,
           "peers": {"vllm_80pct_0p3": False, "triton_kernels": False}}  # fmt: skip
    rec.update(kw)
    return rec


def test_a_patch_is_material_only_where_it_changes_the_output():
    """No effect (bit-identical everywhere) is not a miss; a changed output that passes is MISSED
    (below noise where the change alone passes); a FAIL or an ERROR (a worker that died included) is
    caught. Each changed case's effect is kept by case id."""
    from mxmoe.harness.audits.mutation.patched import _rows

    v = VENDORS["triton"]
    base = {("triton", "c1"): "a", ("triton", "c2"): "b", ("triton-unfused", "c1"): "c", ("triton-unfused", "c2"): "d"}
    p = TRITON_PATCHES[0]
    same = [_rec(b, c, "PASS", d) for (b, c), d in base.items()]
    assert [r.verdict for r in _rows(p, v, same, base)] == ["no effect", "no effect"]
    changed = same[:1] + [_rec("triton", "c2", "PASS", "other")] + same[2:]
    rows = _rows(p, v, changed, base)
    want = [("triton", "MISSED", 1), ("triton-unfused", "no effect", 0)]
    assert [(r.backend, r.verdict, r.differs) for r in rows] == want
    assert rows[0].effects == {"c2": None} and rows[1].effects == {}  # which case changed, unjudged
    weak = {"over_bound": 0, "z": 2.0, "z_threshold": 7.8, "energy": None, "energy_threshold": None, "material": False}
    row = _rows(p, v, same[:1] + [_rec("triton", "c2", "PASS", "other", effect=weak)] + same[2:], base)[0]
    assert (row.verdict, row.effects) == ("below noise", {"c2": weak})
    assert row.to_dict()["effects"] == {"c2": weak}  # in the --json record, case by case
    died = [_rec("triton", "c1", "ERROR", "none", worst_ratio=float("inf"), reason="the worker process died")]
    row = _rows(p, v, died, base)[0]
    assert (row.verdict, row.errors, row.failure) == ("caught", 1, "c1: the worker process died")
    control = _rows(None, v, [_rec("triton", "c1", "FAIL", "a", over_bound=3)], {})[0]
    assert control.verdict == "FAILS UNPATCHED"


def test_a_change_is_material_where_alone_it_fails_the_tests(host_device):
    """A change far below the bound on one element is not material; one expert's GEMM2 bias taken
    off its tokens, scaled to 0.95 of the bound at most, is material by its projection alone; a change
    past the bound is material by the bound."""
    from mxmoe.harness.audits.mutation.patched import effect_alone
    from mxmoe.harness.contract.cases import make_case
    from mxmoe.harness.contract.inputs import make_inputs
    from mxmoe.harness.instruments.honest import HonestFp32
    from mxmoe.harness.judge.bounds import reference_and_bound

    case = make_case("small", 33)
    inputs = make_inputs(case, host_device)
    bounded = reference_and_bound(inputs, HonestFp32.declaration.arithmetic)
    bound = bounded.bound
    tiny = torch.zeros_like(bound)
    tiny[0, 0] = 1e-3 * float(bound[0, 0])
    assert not effect_alone(inputs.weights, bounded, tiny).material
    terms = bounded.terms
    b2 = inputs.weights.w2_bias.double().to(bound.device)
    token_of, slot = (terms.ids == int(terms.ids[0, 0])).nonzero(as_tuple=True)
    expert = int(terms.ids[0, 0])
    moved = -b2[expert]
    weights = terms.weight.double().to(bound.device)[token_of, slot]
    shifted = torch.zeros_like(bound)
    shifted[token_of] = weights[:, None] * moved
    scale = 0.95 * float((bound[token_of] / shifted[token_of].abs().clamp(min=1e-30)).min())
    shifted = shifted * scale  # within the bound everywhere, at 0.95 of it at most
    assert int((shifted.abs() > bound).sum()) == 0
    e = effect_alone(inputs.weights, bounded, shifted)
    assert e.material and e.over_bound == 0 and e.z > e.z_threshold, e
    past = torch.zeros_like(bound)
    past[1, 2] = 2 * float(bound[1, 2])
    assert effect_alone(inputs.weights, bounded, past).over_bound == 1


def test_a_patch_is_caught_only_where_every_material_change_fails():
    """Changes judged alone: a PASS on a material change is MISSED even beside a catch; changes
    none of which is material, all passing, are below noise; an unjudged change counts as material."""
    from mxmoe.harness.audits.mutation.patched import _rows

    v = VENDORS["triton"]
    base = {("triton", "c1"): "a", ("triton", "c2"): "b", ("triton-unfused", "c1"): "c", ("triton-unfused", "c2"): "d"}
    p = TRITON_PATCHES[0]
    big, small = {"material": True}, {"material": False}
    recs = [_rec("triton", "c1", "FAIL", "x", effect=big), _rec("triton", "c2", "PASS", "y", effect=big),
            _rec("triton-unfused", "c1", "PASS", "x", effect=small),
            _rec("triton-unfused", "c2", "PASS", "d")]  # fmt: skip
    rows = _rows(p, v, recs, base)
    assert [(r.verdict, r.differs, r.material, r.material_missed) for r in rows] == [
        ("MISSED", 2, 2, 1), ("below noise", 1, 0, 0)]  # fmt: skip
    recs[1] = _rec("triton", "c2", "PASS", "y", effect=small)
    assert _rows(p, v, recs, base)[0].verdict == "caught"
    recs[2] = _rec("triton-unfused", "c1", "PASS", "x")  # no effect recorded: counted as material
    assert _rows(p, v, recs, base)[1].verdict == "MISSED"


def test_vllms_patched_copy_is_of_the_release_the_driver_boots(monkeypatch, tmp_path):
    """Without an installed vLLM the mutation worker copies the runtime of ``driven_release()``, the
    release the vLLM driver boots ($MXMOE_VLLM_VERSION, else NEWEST_VLLM): the patched copy put first
    on the path and the booted runtime are one release."""
    import importlib.util

    from mxmoe.harness.upstream import vllm_runtime

    unpacked = []
    monkeypatch.setattr(vllm_runtime, "installed_vllm", lambda: None)
    monkeypatch.setattr(vllm_runtime, "unpack", lambda version: unpacked.append(version) or tmp_path / version)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.setenv("MXMOE_VLLM_VERSION", "0.33.0")
    assert VENDORS["vllm"].locate() == tmp_path / "0.33.0" / "vllm"
    monkeypatch.delenv("MXMOE_VLLM_VERSION")
    assert VENDORS["vllm"].locate() == tmp_path / NEWEST_VLLM / "vllm"
    assert unpacked == ["0.33.0", NEWEST_VLLM]
