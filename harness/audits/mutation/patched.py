"""Copy a vendor's source, patch it, run the registry's adapters on it in a fresh process, and
make the matrix (see the package docstring)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mxmoe.harness.audits.catalogue import PEER_RULES, UNPATCHED_FAILS, Row
from mxmoe.harness.upstream.patches import (
    AITER_PATCHES,
    FLASHINFER_PATCHES,
    TRITON_PATCHES,
    VLLM_PATCHES,
    Patch,
    PatchError,
    replace_line,
)

if TYPE_CHECKING:  # the worker imports this module before the vendor copy: nothing heavy up front
    import torch

    from mxmoe.harness.judge.bounds import Bounded
    from mxmoe.reference.moe import MoEWeights


@dataclass(frozen=True)
class Vendor:
    """A vendor whose kernels are mutated: its import name, how to find its source, which
    registry adapters run it, and its patches."""

    name: str
    package: str
    backends: tuple[str, ...]
    patches: tuple[Patch, ...]
    locate: Callable[[], Path]
    """The package folder to copy (raises with how to get it when there is none)."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment the worker runs with."""
    interpret_as: str | None = None
    """On a CPU host: run the kernels under Triton's interpreter on this architecture's code path
    (``harness.audits.mutation.interpret``); None: only where the hardware is."""
    target_modules: tuple[str, ...] = ()
    """Modules that read the GPU target when imported (imported under ``interpret_as``'s)."""


def _triton_kernels_dir() -> Path:
    from mxmoe.harness.upstream.fetch import import_triton_kernels

    return Path(import_triton_kernels().__file__).parent


AITER_TESTED = "e4048607a535ace3a2b51ded31b1c8c2d45c0879"
"""The ROCm/aiter commit the AITER patches were written against (any commit whose lines match
applies)."""


def _aiter_dir() -> Path:
    """An installed aiter's package folder, else the newest ``<cache>/vendor/aiter-*/aiter``."""
    import importlib.util

    from mxmoe.harness.upstream.fetch import VendorMissing, cache_dir

    spec = importlib.util.find_spec("aiter")
    if spec is not None and spec.origin:
        return Path(spec.origin).parent
    found = sorted((cache_dir() / "vendor").glob("aiter-*/aiter/__init__.py"), key=lambda p: p.stat().st_mtime)
    if found:
        return found[-1].parent
    raise VendorMissing(
        f"no aiter: neither installed nor in {cache_dir() / 'vendor'}/aiter-<commit>/aiter. On a CPU, put aiter's "
        f"source there (git clone https://github.com/ROCm/aiter; git checkout {AITER_TESTED[:8]}, tested; only the "
        "Python files under aiter/ are read, with AITER_TRITON_ONLY=1)"
    )


def _vllm_dir() -> Path:
    """vLLM's package folder: an installed vLLM's, else the runtime's of the release the driver
    boots (``driven_release``), unpacked."""
    import importlib.util

    from mxmoe.harness.upstream.vllm_runtime import driven_release, installed_vllm, unpack

    found = installed_vllm()
    if found is not None:
        return found
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin:
        return Path(spec.origin).parent
    return unpack(driven_release()) / "vllm"


def _flashinfer_dir() -> Path:
    """The installed FlashInfer's package folder (its Python wrapper is what the patches edit; the
    compiled kernel is the one the adapter finds, FlashInfer's own or the project's subset build)."""
    import importlib.util

    from mxmoe.harness.upstream.fetch import VendorMissing

    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.origin:
        raise VendorMissing("no flashinfer installed: pip install flashinfer-python==0.6.14 (and on a GPU, "
                            "python -m harness build-flashinfer for its SM90 MoE kernel)")  # fmt: skip
    return Path(spec.origin).parent


VLLM_BACKENDS = ("vllm-triton", "vllm-triton-unfused", "vllm-flashinfer-cutlass-mxfp4-bf16", "marlin", "triton",
                 "triton-unfused", "flashinfer-cutlass-mxfp4-bf16")  # fmt: skip
"""vLLM's layer for each backend it runs on Hopper, and the direct adapters of the same kernels (which
convert the weights themselves: a planted bug in vLLM's preparation must reach only the former)."""


VENDORS: dict[str, Vendor] = {
    "triton": Vendor("triton", "triton_kernels", ("triton", "triton-unfused"), TRITON_PATCHES, _triton_kernels_dir),
    "aiter": Vendor(
        "aiter", "aiter", ("aiter-triton-mxfp4-bf16",), AITER_PATCHES, _aiter_dir,
        env=(("AITER_TRITON_ONLY", "1"),), interpret_as="gfx942",
        target_modules=("aiter.ops.triton.utils._triton.arch_info",),
    ),
    "vllm": Vendor("vllm", "vllm", VLLM_BACKENDS, VLLM_PATCHES, _vllm_dir),
    "flashinfer": Vendor(
        "flashinfer", "flashinfer", ("flashinfer-cutlass-mxfp4-bf16",), FLASHINFER_PATCHES, _flashinfer_dir,
    ),
}  # fmt: skip


def vendor(name: str) -> Vendor:
    """The vendor called ``name``; a ValueError naming the accepted ones otherwise."""
    if name not in VENDORS:
        raise ValueError(f"--vendor must be one of {', '.join(VENDORS)}; got {name!r}")
    return VENDORS[name]


def apply(src: Path, dest_root: Path, package: str, patch: Patch | None) -> Path:
    """Copy the package folder ``src`` to ``dest_root/package`` and apply ``patch`` (None: the
    unpatched copy); the folder to put on ``sys.path`` (``dest_root``). Each edit's old line must
    occur exactly once in its file."""
    dest = dest_root / package
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for edit in patch.edits if patch else ():
        path = dest / edit.file
        if not path.is_file():
            raise PatchError(f"patch {patch.slug}: {edit.file} is not in {src}")
        path.write_text(replace_line(path.read_text(), edit, f"patch {patch.slug} ({src})"))
    return dest_root


@dataclass
class VRow(Row):
    """One line of the vendor matrix: a patch (or the unpatched control) through one adapter. A
    catalogue Row (``harness.instruments.faults``), with the adapter, the patch's category, and how many
    cases it changed; ``kind`` is ``control`` (unpatched), ``mutant`` (material) or
    ``immaterial`` (no effect on the cases run)."""

    backend: str = ""
    category: str = ""
    differs: int = 0
    """Cases whose output differs bit for bit from the unpatched kernel's (or that raise)."""
    material: int = 0
    """Of those, the cases where the change is material (``Effect.material``; a raise, or a change
    whose effect could not be judged, counts as material)."""
    material_missed: int = 0
    """Material cases the patched kernel PASSed: the misses."""
    effects: dict[str, dict | None] = field(default_factory=dict)
    """Case id -> the change alone on each case it changed (``Effect`` as a dict, with
    ``material``; None where the patched kernel raised or the change could not be judged): which
    cases a patch cannot move past rounding, and by how little, not only how many."""

    @property
    def verdict(self) -> str:
        """caught / MISSED / below noise / no effect for patches, clean / FAILS UNPATCHED for the
        control: the vendor's kernel as shipped failing is not by itself the harness's false alarm
        (FlashInfer's SM90 race fails that way), and the row cannot tell which it is. A patch is
        caught only where every case it changed materially FAILed or raised; one that changed
        outputs only by less than honest rounding can show is below noise, not a miss (no test at
        the stated false-alarm rate could see it there)."""
        if self.kind == "control" and self.caught and not self.harness_errors:
            return UNPATCHED_FAILS
        if self.kind == "immaterial" and not self.caught:
            return "no effect"
        if self.kind == "mutant" and not self.harness_errors and self.runs:
            if self.material_missed:
                return "MISSED"
            if not self.caught and not self.material:
                return "below noise"
        return super().verdict


@dataclass(frozen=True)
class Effect:
    """What a patch changed on one case, judged alone: the patched output less the unpatched one,
    put through the same tests as an error (the bound element by element, the projections, the
    energy), as if the kernel rounded exactly. Material where that alone FAILs: then the patched
    kernel's error is the change plus honest rounding, and the tests are owed a catch; where it
    passes, no test at the stated false-alarm rate could tell the change from rounding."""

    over_bound: int
    z: float | None
    z_threshold: float | None
    energy: float | None
    energy_threshold: float | None

    @property
    def material(self) -> bool:
        """Whether the change alone FAILs the bound, the systematic test or the energy test."""
        return bool(self.over_bound) or any(
            v is not None and t is not None and v > t
            for v, t in ((self.z, self.z_threshold), (self.energy, self.energy_threshold))
        )


def effect_alone(weights: MoEWeights, bounded: Bounded, delta: torch.Tensor) -> Effect:
    """``Effect`` of ``delta`` (patched less unpatched output, the bound's shape) under ``bounded``."""
    import torch

    from mxmoe.harness.judge.systematic import energy_test, systematic_test

    delta = delta.to(device=bounded.ref.device, dtype=torch.float64)
    got = bounded.ref + delta
    found, energy = systematic_test(weights, bounded, got), energy_test(weights, bounded, got)
    return Effect(
        over_bound=int((~(delta.abs() <= bounded.bound)).sum()),  # a non-finite change is over it
        z=found.z if found else None, z_threshold=found.threshold if found else None,
        energy=energy.ratio if energy else None, energy_threshold=energy.threshold if energy else None,
    )  # fmt: skip


def _worker(v: Vendor, root: Path, profile: str, case_ids: list[str], out: Path,
            tactics: str = "default", outputs: tuple[str, Path] | None = None) -> list[dict]:  # fmt: skip
    """Run ``harness.audits.mutation.worker`` on the copy at ``root``; its records (``outputs``: where
    the control saves its outputs, or where a patched copy finds them to judge its change). Where the process
    dies (a patched kernel that takes the CUDA context down), the check it was running is an ERROR
    with the process's last words, and the checks after it are not run (no record)."""
    cmd = [sys.executable, "-m", "mxmoe.harness.audits.mutation.worker", "--vendor", v.name, "--root", str(root),
           "--profile", profile, "--out", str(out), "--tactics", tactics] + [a for b in v.backends
                                                                            for a in ("--backend", b)]
    cmd += [a for c in case_ids for a in ("--case", c)]  # fmt: skip
    if outputs:  # ("--save", DIR) for the control, ("--baseline", DIR) for a patched copy
        cmd += [outputs[0], str(outputs[1])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | dict(v.env))
    lines = out.read_text().splitlines() if out.is_file() else []
    records = [json.loads(line) for line in lines if line.strip()]
    if proc.returncode != 0:
        done = {(r["backend"], r["case"]) for r in records}
        pending = [(b, c) for c in case_ids for b in v.backends if (b, c) not in done]
        if records and not pending:  # the checks of a tactic, after its adapter's own
            pending = [(records[-1]["backend"], records[-1]["case"])]
        b, c = pending[0] if pending else (v.backends[0], case_ids[0])
        records.append({
            "backend": b, "case": c, "outcome": "ERROR", "worst_ratio": math.inf, "over_bound": 0, "z": None,
            "z_fired": False, "peers": dict.fromkeys(PEER_RULES, True), "digest": "none",
            "reason": f"the worker process died (exit {proc.returncode}) during this check: "
                      + (proc.stderr or proc.stdout).strip()[-1200:],
        })  # fmt: skip
    return records


def none_runs(vendor: str, records: list[dict]) -> str:
    """Why no adapter of ``vendor`` ran a case here, each reason once with the adapters it stops:
    with every tactic a reason such as "declared for sm90 only" holds for 25 adapters, and listing it
    25 times hides it."""
    by_reason: dict[str, list[str]] = {}
    for r in records:
        by_reason.setdefault(r["reason"].replace(r["backend"], "it"), []).append(r["backend"])
    said = []
    for reason, backends in by_reason.items():  # in the order the adapters ran
        names = sorted(set(backends))
        who = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        said.append(f"{who}: {reason}")
    return f"no adapter of {vendor} runs a case on this host: " + "; ".join(said)


def run_vendor(
    v: Vendor, profile: str, case_ids: list[str], jobs: int = 1, log: Callable[[str], None] = print,
    only: list[str] | None = None, tactics: str = "default",
) -> list[VRow]:
    """The unpatched control, then every patch (``only``: those slugs), each through every adapter
    of ``v`` on ``case_ids`` (with ``tactics``, also under the adapters' declared tactics, each a
    row of its own: ``registry.with_tactics``), ``jobs`` worker processes at a time; rows in that
    order."""  # fmt: skip
    src = v.locate()
    patches = [p for p in v.patches if not only or p.slug in only]
    unknown = sorted(set(only or ()) - {p.slug for p in v.patches})
    if unknown:
        names = ", ".join(p.slug for p in v.patches)
        raise ValueError(f"--patch must name patches of {v.name}: {names}; got {unknown}")
    with tempfile.TemporaryDirectory(prefix=f"mxmoe-mutants-{v.name}-") as tmp:
        tmp_path = Path(tmp)
        roots = {None: apply(src, tmp_path / "unpatched", v.package, None)}
        for p in patches:  # every patch applies before anything runs: a stale patch is an error up front
            roots[p.slug] = apply(src, tmp_path / p.slug, v.package, p)
        log(f"{v.name}: {src} copied; {len(patches)} patches applied; adapters {', '.join(v.backends)}")
        saved = tmp_path / "outputs"
        saved.mkdir()
        base = _worker(v, roots[None], profile, case_ids, tmp_path / "unpatched.jsonl", tactics, ("--save", saved))
        control = _rows(None, v, base, {})
        if not any(r.runs for r in control):
            raise RuntimeError(none_runs(v.name, base))
        log("unpatched: " + ", ".join(f"{r.backend} {r.verdict}" for r in control))
        digests = {(r["backend"], r["case"]): r["digest"] for r in base}

        def one(p: Patch) -> list[VRow]:
            recs = _worker(v, roots[p.slug], profile, case_ids, tmp_path / f"{p.slug}.jsonl", tactics,
                           ("--baseline", saved))  # fmt: skip
            rows = _rows(p, v, recs, digests, [r.backend for r in control])
            log(f"{p.slug}: " + ", ".join(f"{r.backend} {r.verdict}" for r in rows))
            return rows

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            patched = [row for rows in pool.map(one, patches) for row in rows]
    return control + patched


def _rows(p: Patch | None, v: Vendor, recs: list[dict], base: dict[tuple[str, str], str],
          backends: list[str] | None = None) -> list[VRow]:  # fmt: skip
    """The worker's records of one copy, a row per adapter (and per tactic of it: ``backends``, the
    control's rows, else those the records name after the vendor's adapters)."""
    def new_row(b: str) -> VRow:
        if p is None:
            return VRow(f"{v.name}:unpatched", "the vendor source as shipped", None, "control", backend=b, category="-")
        return VRow(f"{v.name}:{p.slug}", p.fault, None, "immaterial", backend=b, category=p.category)

    rows = {b: new_row(b) for b in backends or list(dict.fromkeys([*v.backends, *(r["backend"] for r in recs)]))}
    for r in recs:
        # a backend the control never recorded (its worker died first) gets a row of its own
        row = rows.setdefault(r["backend"], new_row(r["backend"]))
        if r["outcome"] == "SKIP":
            row.skips += 1
            continue
        row.runs += 1
        row.outcomes[r["case"]] = r["outcome"]
        if p is not None and (r["outcome"] == "ERROR" or r["digest"] != base.get((r["backend"], r["case"]))):
            row.differs += 1
            row.kind = "mutant"
            effect = r.get("effect")
            row.effects[r["case"]] = effect
            if r["outcome"] == "ERROR" or effect is None or effect["material"]:
                row.material += 1
                row.material_missed += r["outcome"] not in ("FAIL", "ERROR")
        if r["outcome"] in ("FAIL", "ERROR"):
            row.fails += r["outcome"] == "FAIL"
            row.errors += r["outcome"] == "ERROR"
            row.failure = row.failure or f"{r['case']}: {r['reason']}"[:400]
        row.worst_ratio = max(row.worst_ratio, math.inf if r["outcome"] == "ERROR" else r["worst_ratio"])
        row.worst_z = max(row.worst_z, r["z"] or 0.0)
        row.worst_energy = max(row.worst_energy, r.get("energy") or 0.0)
        row.z_only += int(r["outcome"] == "FAIL" and r["z_fired"] and not r["over_bound"])
        for rule in PEER_RULES:
            row.peer_catches[rule] = row.peer_catches.get(rule, 0) + int(r["peers"][rule])
    return list(rows.values())
