"""Drift between vLLM's own MXFP4 MoE oracle and this project's declarations, caught by running vLLM.

The project declares, as data, what each vLLM backend does (``kernels/*.py``: archs, round-ups,
w13 row layout, activations, routing methods) and how vLLM picks one (``harness.selection``).
vLLM changes those under us. This module runs vLLM's own pure-Python pieces, on any host and
without a GPU: its wheel's sources (``python -m harness fetch vllm``: no compiled extension is
loaded) are imported in a subprocess that pretends to be each architecture
(``harness.vllm_probe``), and the facts it prints are compared with the declarations:

* ``round_up``: ``mxfp4_round_up_hidden_size_and_intermediate_size`` against each backend's
  declared alignments, on gpt-oss, DeepSeek and CI-size shapes;
* ``selection``: vLLM's choice for ``auto`` and every ``--moe-backend`` string both know, with
  no, MXFP8 and FP8 activation quantization, against ``harness.selection``;
* ``backends`` and ``moe_backend_strings``: the enum members and strings each side has;
* ``activations``, ``routing_methods`` and ``w13_layout`` of each backend's kernel classes and
  weight conversion.

Every difference is a ``Drift``. Differences that are understood are listed in ``KNOWN`` with
the reason (mostly: the declarations follow vLLM main after PR #50622, newer than the release
probed); ``python -m harness vllm-drift`` exits 1 on any other, and on a known one that no
longer occurs (so the list cannot go stale).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from mxmoe.harness.backend import Declaration
from mxmoe.harness.padding import round_up
from mxmoe.harness.selection import MOE_BACKENDS, Deployment, NoBackend, select_backend
from mxmoe.harness.vendor import DEFAULT_VLLM, VendorMissing, cache_dir, download_vllm_wheel
from mxmoe.reference.routing import ROUTING_METHODS

PROBE_ARCHS = ("sm80", "sm90", "sm100", "sm120", "gfx942", "gfx950", "cpu")
PROBE_DEPS = ("psutil", "pyzmq", "cbor2", "transformers", "aiohttp", "openai-harmony", "openai", "einops")
"""vLLM's pure-Python import dependencies of its MXFP4 oracle (not torch, not triton), installed
into their own folder so that they never touch the environment under test."""
PROBE_ROUTING = "RenormalizeNaive"
"""The routing vLLM derives for GPT-OSS (softmax, renormalize), as the probe configures it."""
QUANT_KEYS = {"none": None, "mxfp8": "mxfp8", "fp8": "fp8"}
"""The probe's activation keys, to ``harness.selection`` activation quantizations."""
ACTIVATION_NAMES = {"swigluoai": "SWIGLUOAI", "silu": "SILU"}


@dataclass(frozen=True)
class Drift:
    """One difference: what (``kind``), of which backend or string (``subject``), on which
    architecture ("*": all), our value and vLLM's, and the reason if it is a known one."""

    kind: str
    subject: str
    arch: str
    ours: str
    vllm: str
    known: str | None = None


_PR50622 = "vLLM PR #50622 (AITER_TRITON_MXFP4_BF16, SPEC section 6) came after 0.26.0"
_ROCM_256 = (
    "0.26.0 rounds every remaining backend to 256/256 on ROCm; a declaration has one alignment (the CUDA "
    "rule). Padding is zeros, so outputs agree; the padding audit understates ROCm's"
)
_CPU = (
    "0.26.0 serves MXFP4 on a CPU with its own CPU backend (not declared here) and runs EMULATION on "
    "CUDA/ROCm only; the project's emulation runs on CPUs by design"
)
KNOWN: dict[tuple[str, str, str], str] = {
    ("backends", "AITER_TRITON_MXFP4_BF16", "*"): _PR50622,
    ("gpt_oss_priority", "auto", "*"): _PR50622 + "; 0.26.0 also lists backends not declared here",
    ("moe_backend_strings", "aiter", "*"): _PR50622 + "; 0.26.0's 'aiter' also tries AITER_MXFP4_MXFP4",
    ("moe_backend_strings", "aiter_triton_mxfp4_bf16", "*"): _PR50622,
    ("selection", "auto/none", "gfx942"): _PR50622 + ": without it 0.26.0 falls to TRITON on gfx942",
    ("selection", "aiter/none", "gfx942"): _PR50622 + ": 0.26.0's 'aiter' has no W4A16 candidate on gfx942",
    ("round_up", "FLASHINFER_TRTLLM_MXFP4_BF16", "*"): "0.26.0 rounds the TRT-LLM intermediate to 256; SPEC says 128",
    ("round_up", "FLASHINFER_TRTLLM_MXFP4_MXFP8", "*"): "0.26.0 rounds the TRT-LLM intermediate to 256; SPEC says 128",
    ("round_up", "TRITON", "gfx942"): _ROCM_256,
    ("round_up", "TRITON", "gfx950"): _ROCM_256,
    ("round_up", "TRITON_UNFUSED", "gfx942"): _ROCM_256,
    ("round_up", "TRITON_UNFUSED", "gfx950"): _ROCM_256,
    ("w13_layout", "TRITON_UNFUSED", "*"): (
        "0.26.0 keeps a GPT-OSS checkpoint's interleaved rows and its interleaved activation; SPEC and the "
        "declaration take the standard chunked [gate; up] path (the same GEMMs)"
    ),
    ("routing_methods", "FLASHINFER_TRTLLM_MXFP4_BF16", "*"): (
        "0.26.0's TRT-LLM classes: the monolithic one takes Renormalize(Naive) only, the modular one routes "
        "outside the kernel (any method); the declaration lists what FlashInfer's in-kernel routing implements"
    ),
    ("routing_methods", "FLASHINFER_TRTLLM_MXFP4_MXFP8", "*"): "as FLASHINFER_TRTLLM_MXFP4_BF16",
    ("routing_methods", "TRITON", "*"): (
        "TRITON's preferred (monolithic) class routes inside triton_kernels, Renormalize(Naive) only: the "
        "`triton` backend; its modular class takes any top-k: the `triton-modular` backend, which declares all"
    ),
    ("routing_methods", "AITER_MXFP4_BF16", "*"): (
        "vLLM routes outside CK (any method); the adapter routes with aiter's topk_softmax as vLLM does for "
        "softmax routing, so it declares the softmax methods only"
    ),
    ("selection", "auto/none", "cpu"): _CPU,
    ("selection", "auto/mxfp8", "cpu"): _CPU,
    ("selection", "auto/fp8", "cpu"): _CPU,
    ("selection", "emulation/none", "cpu"): _CPU,
    ("selection", "emulation/mxfp8", "cpu"): _CPU,
    ("selection", "emulation/fp8", "cpu"): _CPU,
}
"""Understood differences from vLLM 0.26.0, the release ``python -m harness fetch vllm`` takes."""


def vllm_root(version: str = DEFAULT_VLLM) -> Path:
    """The folder holding vLLM's extracted Python sources (``vllm/``)."""
    return cache_dir() / "vendor" / f"vllm-{version}"


def deps_root(version: str = DEFAULT_VLLM) -> Path:
    """The folder holding the probe's pure-Python dependencies (``pip install --target``)."""
    return cache_dir() / "vendor" / f"vllm-{version}-deps"


def fetch_vllm(version: str = DEFAULT_VLLM, wheel: Path | None = None) -> Path:
    """Extract vLLM's Python sources (no compiled extension) from its wheel into the cache and
    install the probe's dependencies beside them; the sources' folder."""
    wheel = wheel or download_vllm_wheel(version)
    root = vllm_root(version)
    tmp = root.with_name(root.name + ".partial")
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith("vllm/") and not n.endswith((".so", "/"))]
        if "vllm/__init__.py" not in names:
            raise VendorMissing(f"{wheel} is not a vLLM wheel (no vllm/__init__.py)")
        z.extractall(tmp, names)
    if root.exists():
        import shutil

        shutil.rmtree(root)
    tmp.rename(root)
    deps = deps_root(version)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(deps), "--upgrade", *PROBE_DEPS]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise VendorMissing(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return root


def probe(arch: str, version: str = DEFAULT_VLLM, timeout: float = 300.0) -> dict:
    """vLLM's facts on ``arch`` (see ``harness.vllm_probe``), from a subprocess: the fake
    platform and vLLM's imports never reach this process."""
    root, deps = vllm_root(version), deps_root(version)
    if not (root / "vllm" / "__init__.py").is_file():
        raise VendorMissing(f"no vLLM {version} sources at {root}; run `python -m harness fetch vllm`")
    boot = (
        "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); sys.path.append(sys.argv.pop(1)); "
        "runpy.run_module('mxmoe.harness.vllm_probe', run_name='__main__', alter_sys=True)"
    )
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-c", boot, str(root), str(deps), "--arch", arch]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the vLLM probe for {arch} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ours_round_up(d: Declaration, h: int, i: int) -> tuple[int, int]:
    return round_up(h, d.hidden_align), round_up(i, d.intermediate_align)


def _selection_ours(arch: str, moe_backend: str, quant: str | None, declarations: list[Declaration]) -> str:
    try:
        dep = Deployment(arch=arch, activation_quant=quant, routing=PROBE_ROUTING, moe_backend=moe_backend)
        return select_backend(dep, declarations).chosen.vllm_backend or "?"
    except NoBackend:
        return "error"


def compare(facts: dict, declarations: list[Declaration]) -> list[Drift]:
    """Every difference between one arch's vLLM facts and the declarations."""
    arch = facts["arch"]
    ours = {d.vllm_backend: d for d in declarations if d.vllm_backend}
    members = set(facts.get("backends", []))
    out: list[Drift] = []
    for name in sorted(set(ours) - members):
        out.append(Drift("backends", name, "*", "declared", "absent"))
    strings = facts.get("moe_backend_strings", {})
    for s, ours_list in MOE_BACKENDS.items():
        if s == "auto":
            theirs_all = facts.get("gpt_oss_priority", [])
        elif s not in strings:
            out.append(Drift("moe_backend_strings", s, "*", ",".join(ours_list), "absent"))
            continue
        else:
            theirs_all = strings[s]
        if list(ours_list) != [m for m in theirs_all if m in ours]:
            kind = "gpt_oss_priority" if s == "auto" else "moe_backend_strings"
            out.append(Drift(kind, s, "*", ",".join(ours_list), ",".join(theirs_all)))
    for name, d in sorted(ours.items()):
        if name not in members:
            continue
        rounded = facts.get("round_up", {}).get(name, {})
        if arch in d.archs:
            mine, theirs = [], []
            for key, val in rounded.items():
                h, i = (int(v) for v in key.split("x"))
                got = _ours_round_up(d, h, i)
                if isinstance(val, str) or list(got) != list(val):
                    mine.append(f"{key}->{got[0]}x{got[1]}")
                    theirs.append(f"{key}->{val if isinstance(val, str) else f'{val[0]}x{val[1]}'}")
            if mine:
                out.append(Drift("round_up", name, arch, "; ".join(mine), "; ".join(theirs)))
        sup = facts.get("supports", {}).get(name, {})
        if isinstance(sup.get("activations"), list):
            theirs = sorted(a for a, v in ACTIVATION_NAMES.items() if v in sup["activations"])
            if theirs != sorted(d.activations):
                out.append(Drift("activations", name, "*", ",".join(sorted(d.activations)), ",".join(theirs)))
        names = facts.get("routing_method_names")
        if isinstance(sup.get("routing_methods"), list) and isinstance(names, list):
            theirs = sorted(r for r in ROUTING_METHODS if r in sup["routing_methods"])
            if theirs != sorted(r for r in d.routing_methods if r in names):  # only methods vLLM has
                out.append(Drift("routing_methods", name, "*", ",".join(sorted(d.routing_methods)), ",".join(theirs)))
        layout = facts.get("w13_layout", {}).get(name)
        if isinstance(layout, str) and not layout.startswith("unknown") and layout != d.w13_layout:
            out.append(Drift("w13_layout", name, "*", d.w13_layout, layout))
    for s, by_key in sorted(facts.get("selection", {}).items()):
        if s not in MOE_BACKENDS:
            continue
        for key, theirs in sorted(by_key.items()):
            if key not in QUANT_KEYS:
                continue
            mine = _selection_ours(arch, s, QUANT_KEYS[key], declarations)
            theirs_name = "error" if str(theirs).startswith("error") else str(theirs)
            if mine != theirs_name:
                out.append(Drift("selection", f"{s}/{key}", arch, mine, theirs_name))
    return out


def mark_known(drifts: list[Drift]) -> list[Drift]:
    """``drifts`` with the reason of each known one filled in."""
    marked = []
    for d in drifts:
        reason = KNOWN.get((d.kind, d.subject, d.arch)) or KNOWN.get((d.kind, d.subject, "*"))
        marked.append(Drift(**{**asdict(d), "known": reason}))
    return marked


def unique(drifts: list[Drift]) -> list[Drift]:
    """One row per (kind, subject, arch, ours, vllm): arch-independent facts repeat per probe."""
    seen, out = set(), []
    for d in drifts:
        key = (d.kind, d.subject, d.arch, d.ours, d.vllm)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def stale_known(drifts: list[Drift]) -> list[tuple[str, str, str]]:
    """Entries of KNOWN that no longer match any drift."""
    hit = {(d.kind, d.subject, d.arch) for d in drifts} | {(d.kind, d.subject, "*") for d in drifts}
    return [k for k in KNOWN if k not in hit]

