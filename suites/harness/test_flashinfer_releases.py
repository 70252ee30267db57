"""Which FlashInfer release the GPU set-up installs and builds for (``flashinfer_releases``): vLLM's
pin, or the nearest newer release PyPI has, said so; ``--flashinfer-version`` on every command that
takes it, refusing a release the harness does not know by naming the accepted ones; and the set-up
plan that follows the choice (an installed release replaced only when another is asked for)."""

from __future__ import annotations

import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from mxmoe.harness.cli.app import main
from mxmoe.harness.upstream import flashinfer_releases as fr
from mxmoe.harness.upstream import gpu_setup
from mxmoe.harness.upstream.fetch import DEFAULT_VLLM, NEWEST_VLLM, cache_dir
from mxmoe.harness.upstream.gpu_setup import Host, plan
from mxmoe.kernels.flashinfer_common import NEWEST_FLASHINFER

FRESH = Host(arch="sm90", flashinfer=None, triton_kernels=True, vllm_installed=True, runtime=False, source=False,
             ops=False, subset=False)  # fmt: skip


def test_each_vllm_gets_its_pin_or_the_nearest_newer_release_with_the_reason():
    assert fr.resolve("0.26.0") == fr.Resolution("0.26.0", "0.6.14", "0.6.14")
    assert fr.resolve("0.33.0") == fr.Resolution("0.33.0", "0.7.2.post1", "0.7.2.post1")
    got = fr.resolve("0.34.0")
    assert (got.pinned, got.release) == ("0.7.3", "0.7.4")
    assert got.note == ("vLLM 0.34.0 pins flashinfer-python 0.7.3, which PyPI does not have; using 0.7.4, the "
                        "nearest newer release")  # fmt: skip
    # nearest, not newest; a post-release counts as newer than its release
    assert fr.resolve("0.34.0", index=("0.7.2.post1", "0.7.3.post1", "0.7.4")).release == "0.7.3.post1"
    with pytest.raises(ValueError, match="pins flashinfer-python 0.7.3, which PyPI does not have, nor any newer"):
        fr.resolve("0.34.0", index=("0.6.14", "0.7.2.post1"))
    with pytest.raises(ValueError, match=r"vLLM 9.9.9's flashinfer-python pin is not in VLLM_PINS"):
        fr.resolve("9.9.9")


def test_the_release_tables_are_one_consistent_set():
    # the vLLM under test and the one the Triton backends' kernels come from are both resolvable
    assert {NEWEST_VLLM, DEFAULT_VLLM} <= set(fr.VLLM_PINS)
    assert fr.resolve().vllm == NEWEST_VLLM
    keys = [fr.version_key(v) for v in fr.INDEX_RELEASES]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert fr.INDEX_RELEASES[-1] == NEWEST_FLASHINFER and "0.7.3" not in fr.INDEX_RELEASES
    assert fr.version_key("0.7.2.post1") > fr.version_key("0.7.2") > fr.version_key("0.6.18.post1")
    with pytest.raises(ValueError):
        fr.version_key("0.7.4rc1")


def _vllm_wheel(version: str) -> Path | None:
    found = sorted((cache_dir() / "wheels").glob(f"vllm-{version}-*.whl"))
    return found[0] if found else None


@pytest.mark.parametrize("vllm", sorted(fr.VLLM_PINS))
def test_each_pin_is_what_the_vllm_wheel_requires(vllm):
    """The table against vLLM's own metadata, where ./dev's prefetch left its wheel in the cache."""
    wheel = _vllm_wheel(vllm)
    if wheel is None:
        pytest.skip(f"no vLLM {vllm} wheel in {cache_dir() / 'wheels'}: `python -m harness fetch vllm --vllm-version "
                    f"{vllm}` downloads it")  # fmt: skip
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    pins = [line.split("==", 1)[1].split(";")[0].strip() for line in meta.splitlines()
            if line.startswith("Requires-Dist: flashinfer-python==")]  # fmt: skip
    assert pins == [fr.VLLM_PINS[vllm]]


@pytest.mark.parametrize(
    ("argv", "says"),
    [(["setup-gpu", "--plan", "--flashinfer-version", "0.7.3"], "argument --flashinfer-version: '0.7.3' is not a"),
     (["build-flashinfer", "--flashinfer-version", "latest"], "argument --flashinfer-version: 'latest' is not a"),
     (["bundle", "--out", "/nonexistent/b", "--flashinfer-version", "0.7.4", "--flashinfer-version", "7.4"],
      "argument --flashinfer-version: '7.4' is not a")],
)  # fmt: skip
def test_a_release_the_harness_does_not_know_is_refused_naming_the_accepted_ones(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "accepted values: 0.6.0, " in err and "0.7.2.post1, 0.7.4" in err


def _install(steps: list) -> list[str]:
    (step,) = [s for s in steps if s.name == "flashinfer"]
    return [" ".join(argv[argv.index("install") + 1 :]) for argv in step.commands]


def test_the_set_up_installs_the_resolved_release_and_builds_the_subset_for_it():
    fi = fr.resolve("0.34.0")
    steps = plan(FRESH, "keep.txt", None, fi)
    light = " ".join(gpu_setup.FLASHINFER_LIGHT_DEPS)
    assert _install(steps) == [f"-q -c keep.txt {light} apache-tvm-ffi==0.1.11",
                               "-q -c keep.txt --no-deps flashinfer-python==0.7.4"]  # fmt: skip
    (fi_step,) = [s for s in steps if s.name == "flashinfer"]
    assert fi.note in fi_step.what
    (subset,) = [s for s in steps if s.name == "flashinfer-sm90-subset"]
    assert subset.skip is None and subset.commands[0][-2:] == ("--flashinfer-version", "0.7.4")
    assert gpu_setup.flashinfer_packages("0.6.14") == ("flashinfer-python==0.6.14", "apache-tvm-ffi==0.1.10")


def test_an_installed_release_stays_unless_another_is_asked_for():
    have = replace(FRESH, flashinfer="0.6.14", subset=True)
    steps = plan(have, None, None, fr.resolve("0.34.0"))
    (fi_step, subset) = [s for s in steps if s.name.startswith("flashinfer")]
    assert fi_step.skip == ("flashinfer-python 0.6.14 is installed (vLLM 0.34.0 would take 0.7.4: "
                            "`--flashinfer-version 0.7.4` replaces it)")  # fmt: skip
    assert subset.skip == "built already for this FlashInfer"
    asked = fr.choose("0.7.4", "0.34.0")
    assert asked.requested and asked.note == "asked for 0.7.4; vLLM 0.34.0 pins 0.7.3"
    steps = plan(have, None, None, fr.choose("0.7.2.post1", "0.34.0"))
    (fi_step, subset) = [s for s in steps if s.name.startswith("flashinfer")]
    assert fi_step.skip is None and "replacing the installed 0.6.14" in fi_step.what
    assert "asked for 0.7.2.post1; vLLM 0.34.0 pins 0.7.3" in fi_step.what
    # the 0.6.14 build does not count for 0.7.2.post1: the subset step runs (and checks its own cache)
    assert subset.skip is None and subset.commands[0][-1] == "0.7.2.post1"


def test_offline_the_release_comes_from_what_the_bundle_holds():
    assert fr.choose(None, "0.34.0", ("0.7.4",)).release == "0.7.4"
    alone = fr.choose(None, "0.33.0", ("0.7.4",))
    assert alone.release == "0.7.4" and alone.note == "vLLM 0.33.0 would take 0.7.2.post1; the bundle holds 0.7.4 alone"
    with pytest.raises(ValueError, match="the bundle holds flashinfer-python 0.6.14, 0.7.4, not 0.7.2.post1"):
        fr.choose(None, "0.33.0", ("0.6.14", "0.7.4"))
    with pytest.raises(ValueError, match="0.7.2.post1 is not in the bundle, which holds flashinfer-python 0.7.4"):
        fr.choose("0.7.2.post1", "0.33.0", ("0.7.4",))


def test_the_plan_command_names_the_release_and_why(capsys):
    assert main(["setup-gpu", "--plan", "--flashinfer-version", "0.7.4"]) == 0
    out = capsys.readouterr().out
    assert f"setup-gpu: flashinfer-python 0.7.4 for vLLM {NEWEST_VLLM}" in out and "set-up plan for this" in out
