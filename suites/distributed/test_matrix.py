"""The nightly matrix: derived from the declarations, committed as a GitHub workflow and a Buildkite
pipeline that never drift from the command and pass their published schemas, with shards that
split the differential suite without loss or overlap."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mxmoe.harness.distributed.matrix import GPU_ARCHS, jobs, render

ROOT = Path(__file__).resolve().parents[2]
FILES = {"github": (ROOT / ".github" / "workflows" / "nightly.yml", "vendor.github-workflows"),
         "buildkite": (ROOT / ".buildkite" / "pipeline.yml", "vendor.buildkite")}  # fmt: skip


@pytest.mark.parametrize("fmt", sorted(FILES))
def test_the_committed_pipeline_is_the_commands_output(fmt):
    path, _ = FILES[fmt]
    assert path.read_text() == render(fmt), (
        f"{path.relative_to(ROOT)} drifted from the matrix: regenerate it with "
        f"`python -m harness matrix --format {fmt} --out {path.relative_to(ROOT)}`")  # fmt: skip


def _check_jsonschema() -> list[str]:
    exe = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent)) or shutil.which("check-jsonschema")
    if exe is None:
        pytest.skip("needs check-jsonschema (the test extra)")
    return [exe]


@pytest.mark.parametrize("fmt", sorted(FILES))
def test_the_pipelines_pass_their_published_schemas_and_a_broken_one_does_not(fmt, tmp_path):
    path, schema = FILES[fmt]
    cmd = [*_check_jsonschema(), "--builtin-schema", schema]
    ok = subprocess.run([*cmd, str(path)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = tmp_path / path.name  # the same file with one required key misspelt: the schema must say so
    key = "runs-on:" if fmt == "github" else "steps:"
    broken.write_text(path.read_text().replace(key, key.replace(":", "x:"), 1))
    bad = subprocess.run([*cmd, str(broken)], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0, "the schema check passed a pipeline with a required key missing"


def test_the_matrix_covers_every_architecture_group_and_rank_count():
    all_jobs = jobs()
    ids = [j.id for j in all_jobs]
    assert len(ids) == len(set(ids))
    for arch in GPU_ARCHS:
        mine = [j for j in all_jobs if j.arch == arch]
        assert any(j.kind == "suite" and "--backend emulation" in j.commands[0] for j in mine), arch
        assert {j.id for j in mine if j.kind == "dist"} == {f"{arch}-{m}{n}" for m in ("tp", "ep") for n in (2, 4, 8)}
    tp8 = next(j for j in all_jobs if j.id == "sm90-tp8")
    assert tp8.gpus == 8 and any("--model gptoss120b --tokens 1,128,4096" in c for c in tp8.commands)
    shards = sorted(j.id for j in all_jobs if j.id.startswith("sm90-portable-"))
    assert shards == ["sm90-portable-1of2", "sm90-portable-2of2"]
    with pytest.raises(ValueError, match="format must be one of github, buildkite, json"):
        render("gitlab")


def _collected(*args: str) -> set[str]:
    cmd = [sys.executable, "-m", "pytest", "suites/engine/test_differential.py", "--collect-only", "-q",
           "-p", "no:cacheprovider", "--backend", "emulation", *args]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return {line for line in out.stdout.splitlines() if "::" in line}


def test_shards_split_the_suite_without_loss_or_overlap():
    everything = _collected()
    parts = [_collected("--shard", f"{i}/3") for i in range(3)]
    assert sum(map(len, parts)) == len(everything) and set().union(*parts) == everything
    assert all(len(p) > len(everything) / 6 for p in parts)  # a hash split, roughly even
    bad = subprocess.run([sys.executable, "-m", "pytest", "suites/engine/test_differential.py", "--collect-only",
                          "-q", "--shard", "3/3"], cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode != 0 and "--shard: expected I/K with 0 <= I < K, got '3/3'" in bad.stderr


def test_every_gpu_job_sets_up_what_it_judges_with_builds_kept_by_release_torch_and_cuda():
    """``./dev setup`` alone installs no vendor piece: a job without ``setup-gpu`` would SKIP every
    vendor backend. Each GPU job runs it, after restoring the builds of the nights with its key."""
    import yaml

    from mxmoe.harness.distributed.matrix import CACHE_KEY, SETUP_GPU, flashinfer_releases
    from mxmoe.harness.upstream.fetch import PREVIOUS_VLLM
    from mxmoe.harness.upstream.flashinfer_releases import INDEX_RELEASES, resolve

    gh = yaml.safe_load(FILES["github"][0].read_text())["jobs"]["gpu"]["steps"]
    names = [s.get("uses") or s.get("run") for s in gh]
    key, cache, setup = (next(i for i, n in enumerate(names) if want in n)
                         for want in ("matrix.key", "actions/cache", "matrix.setup"))  # fmt: skip
    assert names.index("./dev setup") < key < cache < setup < names.index("${{ matrix.command }}"), names
    assert gh[cache]["with"] == {"path": ".cache", "key": "${{ steps.key.outputs.key }}"}
    bk = yaml.safe_load(FILES["buildkite"][0].read_text())["steps"]
    for step in (s for s in bk if s.get("key") not in (None, "report")):
        cmds = step["command"]
        assert cmds[0] == "./dev setup" and CACHE_KEY in cmds[1] and "MXMOE_CACHE" in cmds[1], cmds
        assert cmds[2].startswith(SETUP_GPU), cmds
    # each job sets up its own FlashInfer release: the pin's by default, the newest in jobs of its own
    include = {j["id"]: j for j in yaml.safe_load(FILES["github"][0].read_text())["jobs"]["gpu"]["strategy"]["matrix"]
               ["include"]}  # fmt: skip
    assert include["sm90-flashinfer-1of4"]["setup"] == SETUP_GPU and include["sm90-flashinfer-1of4"]["key"] == CACHE_KEY
    others = flashinfer_releases()[1:]
    assert set(others) <= set(INDEX_RELEASES) and resolve().release not in others
    assert resolve(PREVIOUS_VLLM).release in others + (resolve().release,)
    assert INDEX_RELEASES[-1] in others + (resolve().release,)
    newest = others[0]
    tag = newest.replace(".", "_")
    job = include[f"sm90-flashinfer{tag}-1of4"]
    assert job["setup"] == f"{SETUP_GPU} --flashinfer-version {newest}", job
    assert job["key"] == f"{CACHE_KEY} --flashinfer-version {newest}", job
    assert f"--results results/sm90-flashinfer{tag}-1of4" in job["command"]


def test_the_cache_key_names_the_releases_and_what_they_were_built_against():
    import torch
    import triton

    from mxmoe.harness.upstream.fetch import NEWEST_VLLM

    out = subprocess.run([sys.executable, "-m", "harness", "setup-gpu", "--cache-key"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    key = out.stdout.strip()
    for part in (f"vllm{NEWEST_VLLM}", f"torch{torch.__version__}", f"triton{triton.__version__}", "flashinfer",
                 f"py{sys.version_info.major}.{sys.version_info.minor}"):  # fmt: skip
        assert part in key, (part, key)
    assert len(key.splitlines()) == 1 and " " not in key
