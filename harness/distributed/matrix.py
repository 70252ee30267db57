"""The nightly CI matrix: which jobs run where, emitted for GitHub Actions, Buildkite or as JSON.

Jobs are derived from the registry's declarations, never listed by hand, so a new backend or
architecture appears in the matrix by declaring it:

* **suite jobs**: architecture x backend group x shard: the nightly profile of the differential
  suite for the group's backends on that architecture, with one pytest-xdist worker per GPU
  (``-n auto``) and the profile split by ``--shard I/K`` (a test's shard is a hash of its id, so
  the split never depends on collection order);
* **distributed jobs**: architecture x TP or EP x 2, 4, 8 ranks (as many GPUs), gpt-oss-20b and
  -120b layer shapes at T = 1, 128, 4096, through the architecture's Triton backends;
* **report**: after every job, whatever each ended with, one sign-off report merged from every
  job's results folder (uploaded as artifacts named after the job).

A GPU job sets up what it judges: ``./dev setup`` (the Python packages), then ``setup-gpu``
(triton_kernels, FlashInfer and its SM90 subset, vLLM's runtime and ops), with the builds kept
between nights in a cache keyed by the releases and the torch, triton, CUDA or ROCm and Python
they were built against (``setup-gpu --cache-key``): GitHub's ``actions/cache`` over ``.cache``,
and on Buildkite a folder per key under ``$MXMOE_BUILDS`` (``MXMOE_CACHE``). A night with the
same key spends seconds, not the subset build's minutes, before its first case.

Self-hosted runners are chosen by labels: ``self-hosted``, ``linux``, the architecture token
(``sm90``, ``gfx942``, ...) and ``gpus-N``; Buildkite agents by the tags ``queue=gpu``, ``arch``
and ``gpus``. The committed ``.github/workflows/nightly.yml`` and ``.buildkite/pipeline.yml`` are
this module's output (a test regenerates and compares them, and checks both against their
published schemas with check-jsonschema).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json

from mxmoe.harness.distributed import MULTICAST_OFF

GROUPS = {
    "portable": ("emulation", "portable-triton", "portable-triton-chunked"),
    "triton": ("triton", "triton-*"),
    "flashinfer": ("flashinfer-*",),
    "aiter": ("aiter-*",),
    "marlin": ("marlin",),
    "vllm": ("vllm-*",),
}
"""Backend groups (globs over ids): one suite job per group and architecture that has any."""
SHARDS = {"portable": 2, "flashinfer": 4}
"""Shards per group (default 1): the portable backends run every case on every architecture, and
FlashInfer's CUTLASS kernel runs under each of its 24 tactics on SM90."""
GPU_ARCHS = ("sm90", "sm100", "sm120", "gfx942", "gfx950")
"""Architectures the nightly matrix covers (each needs runners with its label)."""
RUNNER_GPUS = 8
"""GPUs of a suite job's runner (the distributed jobs ask for as many as they have ranks)."""
DIST_BACKENDS = ("triton", "portable-triton")
DIST_WORLDS = (2, 4, 8)
DIST_MODELS = ("gptoss20b", "gptoss120b")
DIST_TOKENS = "1,128,4096"
FORMATS = ("github", "buildkite", "json")


@dataclasses.dataclass(frozen=True)
class Job:
    """One job of the matrix."""

    id: str
    arch: str
    kind: str  # "suite" or "dist"
    gpus: int
    commands: tuple[str, ...]
    flashinfer: str = ""
    """The FlashInfer release the job sets up, where not the one the vLLM under test pins (empty)."""

    @property
    def setup(self) -> str:
        """Its ``setup-gpu`` command (``SETUP_GPU``, for its release)."""
        return SETUP_GPU + (f" --flashinfer-version {self.flashinfer}" if self.flashinfer else "")

    @property
    def cache_key(self) -> str:
        """The command that prints its builds' cache key (``CACHE_KEY``, for its release)."""
        return CACHE_KEY + (f" --flashinfer-version {self.flashinfer}" if self.flashinfer else "")

    @property
    def results(self) -> str:
        return f"results/{self.id}"


def _declared() -> dict[str, tuple[str, ...]]:
    from mxmoe.harness.run.registry import discover, select

    return {i.backend.declaration.id: tuple(i.backend.declaration.archs) for i in select(discover())}


def flashinfer_releases() -> tuple[str, ...]:
    """The FlashInfer group's releases: "" for the one the vLLM under test pins (which every job
    sets up by default), then the previous vLLM's pin and the newest on PyPI, each where it is
    another. A user of vLLM runs its pin (or the previous release's, until they upgrade); one who
    installs FlashInfer alone gets the newest."""
    from mxmoe.harness.upstream.fetch import PREVIOUS_VLLM
    from mxmoe.harness.upstream.flashinfer_releases import INDEX_RELEASES, resolve

    out = [""]
    for release in (resolve(PREVIOUS_VLLM).release, INDEX_RELEASES[-1]):
        if release != resolve().release and release not in out:
            out.append(release)
    return tuple(out)


def jobs(declared: dict[str, tuple[str, ...]] | None = None) -> list[Job]:
    """Every job (module docstring), in a stable order."""
    declared = _declared() if declared is None else declared
    out = []
    for arch in GPU_ARCHS:
        for group, globs in GROUPS.items():
            ids = sorted(b for b, archs in declared.items() if arch in archs and any(
                fnmatch.fnmatchcase(b, g) for g in globs))  # fmt: skip
            if not ids:
                continue
            k = SHARDS.get(group, 1)
            for release in flashinfer_releases() if group == "flashinfer" else ("",):
                for i in range(k):
                    jid = f"{arch}-{group}{release.replace('.', '_')}-{i + 1}of{k}"  # a Buildkite key has no dots
                    selection = " ".join(f"--backend {b}" for b in ids)
                    cmd = (f"./dev py -m pytest suites/engine/test_differential.py --profile nightly -n auto -k {arch} "
                           f"{selection} --tactics all --shard {i}/{k} --results results/{jid}")  # fmt: skip
                    out.append(Job(jid, arch, "suite", RUNNER_GPUS, (cmd,), release))
        backends = [b for b in DIST_BACKENDS if arch in declared.get(b, ())]
        if not backends:
            continue
        for mode in ("tp", "ep"):
            for world in DIST_WORLDS:
                jid = f"{arch}-{mode}{world}"
                selection = " ".join(f"--backend {b}" for b in backends)
                cmds = tuple(f"./dev py -m harness dist-check --{mode} {world} --model {m} --tokens {DIST_TOKENS} "
                             f"{selection} --results results/{jid}" for m in DIST_MODELS)  # fmt: skip
                out.append(Job(jid, arch, "dist", world, cmds))
    return out


SETUP_GPU = "./dev py -m harness setup-gpu --keep-installed .cache/keep-installed.txt"
"""A GPU job's second set-up step, after ``./dev setup``: triton_kernels, FlashInfer and its SM90
subset, vLLM's runtime and ops, each only where missing (the cache keeps the builds between
nights); without it every vendor backend of the job would SKIP. A step that fails is named in the
log and the job goes on: the backends it served SKIP, saying what is missing."""
CACHE_KEY = "./dev py -m harness setup-gpu --cache-key"
"""What the builds' cache is keyed by: the releases built, and the torch, triton, CUDA or ROCm and
Python built against (``gpu_setup.cache_key``)."""


def buildkite_cache(job: Job) -> str:
    """On a Buildkite agent the builds live outside the checkout (which the agent cleans), in a folder
    per cache key under ``$MXMOE_BUILDS`` (``$$`` is Buildkite's escape for a shell's ``$``)."""
    return 'export MXMOE_CACHE="$${MXMOE_BUILDS:-$$HOME/.cache/mxmoe-builds}/$$(' + job.cache_key + ')"'


REPORT = ("./dev py -m harness report results --out report --policy kernels-only",)
"""The merge job gates kernels only (its jobs run kernel suites and sharded checks): the policy named
kernels-only waives the other evidence, and a SHIP says so in its headline."""


def github(all_jobs: list[Job]) -> str:
    """The GitHub Actions workflow (YAML)."""
    import yaml

    include = [{"id": j.id, "runs-on": ["self-hosted", "linux", j.arch, f"gpus-{j.gpus}"], "setup": j.setup,
                "key": j.cache_key, "command": " && ".join(j.commands), "results": j.results}
               for j in all_jobs]  # fmt: skip
    workflow = {
        "name": "nightly",
        "on": {"schedule": [{"cron": "0 2 * * *"}], "workflow_dispatch": {}},
        "env": dict(MULTICAST_OFF),
        "jobs": {
            "gpu": {
                "name": "${{ matrix.id }}",
                "runs-on": "${{ matrix.runs-on }}",
                "timeout-minutes": 360,
                "strategy": {"fail-fast": False, "matrix": {"include": include}},
                "steps": [
                    {"uses": "actions/checkout@v4"},
                    {"name": "set up (keeps the runner's CUDA or ROCm torch)", "run": "./dev setup"},
                    {"name": "the builds' cache key", "id": "key",
                     "run": 'echo "key=$(${{ matrix.key }})" >> "$GITHUB_OUTPUT"'},
                    {"name": "the builds of earlier nights", "uses": "actions/cache@v4",
                     "with": {"path": ".cache", "key": "${{ steps.key.outputs.key }}"}},
                    {"name": "set up the production kernels (what the cache lacks)", "run": "${{ matrix.setup }}",
                     "continue-on-error": True},
                    {"name": "run", "run": "${{ matrix.command }}"},
                    {"name": "keep the results", "if": "always()", "uses": "actions/upload-artifact@v4",
                     "with": {"name": "results-${{ matrix.id }}", "path": "${{ matrix.results }}",
                              "if-no-files-found": "warn"}},
                ],
            },
            "report": {
                "needs": "gpu",
                "if": "always()",
                "runs-on": "ubuntu-latest",
                "steps": [
                    {"uses": "actions/checkout@v4"},
                    {"name": "set up", "run": "./dev setup"},
                    {"uses": "actions/download-artifact@v4", "with": {"pattern": "results-*", "path": "results"}},
                    {"name": "sign-off report", "run": REPORT[0]},
                    {"name": "keep the report", "if": "always()", "uses": "actions/upload-artifact@v4",
                     "with": {"name": "signoff", "path": "report"}},
                ],
            },
        },
    }  # fmt: skip
    return _header("github") + yaml.safe_dump(workflow, sort_keys=False, width=200)


def buildkite(all_jobs: list[Job]) -> str:
    """The Buildkite pipeline (YAML)."""
    import yaml

    steps: list[dict] = [
        {"label": f"{j.id}", "key": j.id,
         "command": ["./dev setup", buildkite_cache(j), f"{j.setup} || echo 'setup-gpu failed: its backends SKIP'",
                     *j.commands],
         "agents": {"queue": "gpu", "arch": j.arch, "gpus": str(j.gpus)},
         "artifact_paths": [f"{j.results}/**/*"], "timeout_in_minutes": 360}
        for j in all_jobs
    ]  # fmt: skip
    steps.append({"wait": None, "continue_on_failure": True})
    steps.append({"label": "sign-off report", "key": "report",
                  "command": ["./dev setup", "buildkite-agent artifact download 'results/**/*' .", *REPORT],
                  "artifact_paths": ["report/*"]})  # fmt: skip
    return _header("buildkite") + yaml.safe_dump({"env": dict(MULTICAST_OFF), "steps": steps}, sort_keys=False,
                                                 width=200)  # fmt: skip


def _header(fmt: str) -> str:
    return (f"# Generated by `python -m harness matrix --format {fmt}`; do not edit (a test regenerates and "
            "compares it).\n")  # fmt: skip


def render(fmt: str, all_jobs: list[Job] | None = None) -> str:
    """The matrix in ``fmt`` (one of FORMATS)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    all_jobs = jobs() if all_jobs is None else all_jobs
    if fmt == "github":
        return github(all_jobs)
    if fmt == "buildkite":
        return buildkite(all_jobs)
    return json.dumps([dataclasses.asdict(j) | {"results": j.results} for j in all_jobs], indent=1) + "\n"
