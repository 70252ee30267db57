"""Drift between vLLM's own MXFP4 MoE oracle and this project's declarations, caught by running vLLM.

The project declares, as data, what each vLLM backend does (``kernels/*.py``: archs, round-ups,
w13 row layout, activations, routing methods) and how vLLM picks one (``harness.upstream.selection``).
vLLM changes those under us. This module runs vLLM's own pure-Python pieces, on any host and
without a GPU: its wheel's sources (``python -m harness fetch vllm``: no compiled extension is
loaded) are imported in a subprocess that pretends to be each architecture
(``harness.upstream.vllm_probe``), and the facts it prints are compared with the declarations:

* ``round_up``: ``mxfp4_round_up_hidden_size_and_intermediate_size`` against each backend's
  declared alignments, on gpt-oss, DeepSeek and CI-size shapes;
* ``selection``: vLLM's choice for ``auto`` and every ``--moe-backend`` string both know, with
  no, MXFP8 and FP8 activation quantization, against ``harness.upstream.selection``;
* ``backends``, ``gpt_oss_priority`` and ``moe_backend_strings``: the enum members, the ``auto``
  order on each architecture and the strings each side has;
* ``activations``, ``routing_methods`` and ``w13_layout`` of each backend's kernel classes and
  weight conversion;
* ``needs_biases``: whether that conversion takes a layer without biases, against
  ``Declaration.vllm_needs_biases`` (vLLM's own layer of a backend that asserts them declares no
  case without biases).

The declarations and the selection follow NEWEST_VLLM, 0.34.0; PREVIOUS_VLLM, 0.33.0, and
DEFAULT_VLLM, 0.26.0 (the release whose vendored triton_kernels the Triton backends run), are
checked as well. Every difference is a ``Drift``. Differences that are understood are listed, with
the reason, per vLLM release in ``KNOWN_BY_VERSION``: ``KNOWN_V34`` and ``KNOWN_V33`` hold only
limitations (what the adapters do not implement, what a declaration cannot say, the project's own
choices; 0.33.0's oracle answers as 0.34.0's does in everything compared), ``KNOWN_V26`` those
limitations too and where 0.26.0 is older than the declarations (no PR #50622, no bf16 fallback,
one ``auto`` order, the TRT-LLM round-up). ``python -m harness vllm-drift [--vllm-version V]``
(default NEWEST_VLLM) exits 1 on any other, and on a known one of that release that no longer occurs
(so the lists cannot go stale). ``python -m harness fetch vllm --vllm-version V`` takes a release's
sources and the probe's dependencies (``probe_deps``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from mxmoe.harness.contract.backend import Declaration
from mxmoe.harness.contract.padding import round_up
from mxmoe.harness.upstream.fetch import (
    DEFAULT_VLLM,
    NEWEST_VLLM,
    PREVIOUS_VLLM,
    VendorMissing,
    cache_dir,
    download_vllm_wheel,
    release,
)
from mxmoe.harness.upstream.selection import (
    GPT_OSS_PRIORITY,
    MOE_BACKENDS,
    Deployment,
    NoBackend,
    gpt_oss_priority,
    select_backend,
)
from mxmoe.harness.upstream.vllm_probe import PROBE_ARCHS  # the archs it checks, owned by the probe
from mxmoe.reference.routing import ROUTING_METHODS

PROBE_DEPS = ("psutil", "pyzmq", "cbor2", "transformers", "aiohttp", "openai-harmony", "openai", "einops")
"""vLLM's import dependencies of its MXFP4 oracle (not torch, not triton), installed into their own
folder so that they never touch the environment under test: those of 0.26.0 (DEFAULT_VLLM)."""
PROBE_DEPS_SINCE = {
    # 0.33.0's oracle import path reaches the API server, the KV-transfer and structured-output
    # modules at import (fused_moe -> _aiter_ops -> ... -> v1.request). Its grammar libraries
    # (xgrammar, llguidance: native) are not installed: the probe stubs them (IMPORT_ONLY_STUBS).
    # 0.34.0's adds none.
    "0.33.0": ("pybase64", "cachetools", "msgspec", "uvloop", "prometheus-client", "fastapi", "partial-json-parser"),
}
"""Dependencies a vLLM release's oracle added to PROBE_DEPS, by the first release that needs them."""


def probe_deps(version: str = DEFAULT_VLLM) -> tuple[str, ...]:
    """The packages ``fetch_vllm`` installs for VERSION's probe: PROBE_DEPS and those every release up to
    VERSION added."""
    added = [d for since, deps in PROBE_DEPS_SINCE.items() if release(since) <= release(version) for d in deps]
    return PROBE_DEPS + tuple(dict.fromkeys(added))


PROBE_ROUTING = "RenormalizeNaive"
"""The routing vLLM derives for GPT-OSS (softmax, renormalize), as the probe configures it."""
QUANT_KEYS = {"none": None, "mxfp8": "mxfp8", "fp8": "fp8"}
"""The probe's activation keys, to ``harness.upstream.selection`` activation quantizations."""
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
    vllm_version: str = NEWEST_VLLM
    """The release the facts came from (whose KNOWN explains it)."""


Key = tuple[str, str, str]
"""(kind, subject, arch) of a known difference; arch "*" stands for every architecture."""


def _each(kind: str, subjects: tuple[str, ...], archs: tuple[str, ...], reason: str) -> dict[Key, str]:
    """One KNOWN entry per (subject, arch): each must keep occurring, or it is reported stale."""
    return {(kind, s, a): reason for s in subjects for a in archs}


# Limitations the project keeps on purpose or cannot lift from the declarations alone, in both
# releases (each read in both releases' sources).
_CPU = (
    "On a CPU vLLM serves MXFP4 with its own CPU backend, which is not declared here, and runs EMULATION on GPUs "
    "only (TritonExperts._supports_current_device: CUDA, ROCm, XPU). The project's EMULATION runs on a CPU on "
    "purpose: it is how the harness checks itself without a GPU"
)
_SHARED: dict[Key, str] = {
    ("w13_layout", "TRITON_UNFUSED", "*"): (
        "vLLM gives TRITON_UNFUSED a GPT-OSS checkpoint's gate and up rows still interleaved (only swizzled, as for "
        "TRITON) and an activation that reads them so. The project runs the same two GEMMs on rows chunked "
        "[gate; up] with the standard activation (docs/formats.md): a deliberate choice, the arithmetic is the same"
    ),
    ("routing_methods", "TRITON", "*"): (
        "vLLM's TRITON has two kernel classes: the preferred one routes inside triton_kernels (Renormalize and "
        "RenormalizeNaive only), the other takes the top-k from vLLM's router (any method). The project tests them "
        "as two backends: `triton` (this declaration) and `triton-modular`, which declares every method"
    ),
    ("routing_methods", "AITER_MXFP4_BF16", "*"): (
        "vLLM routes before it calls AITER's CK MoE, so any method reaches the kernel. The adapter routes with "
        "aiter's topk_softmax, as vLLM does for softmax routing, and implements no other router: it declares the "
        "softmax methods only"
    ),
    **_each("selection", ("auto/none", "auto/mxfp8", "auto/fp8"), ("cpu",), _CPU),
    **_each("selection", ("emulation/none", "emulation/mxfp8", "emulation/fp8"), ("cpu",), _CPU),
}

_ROCM_256 = (
    "On ROCm vLLM {v} pads TRITON and TRITON_UNFUSED to multiples of 256 "
    "(mxfp4_round_up_hidden_size_and_intermediate_size: 128 only for TRITON_UNFUSED with SiLU or SiTU before CDNA4, "
    "and gpt-oss's Mxfp4MoEMethod.maybe_roundup_sizes passes no activation). A declaration has one pair of "
    "alignments for every architecture, and these follow vLLM on CUDA. The padding is zeros, so results agree; "
    "only the padding audit shows less padding than ROCm has"
)
_TRTLLM_CLASSES = {
    "0.33.0": "two TRT-LLM kernel classes: the preferred one routes inside FlashInfer (Renormalize, RenormalizeNaive, "
    "DeepSeekV3), the other takes the top-k from vLLM's router (any method)",
    "0.34.0": "three TRT-LLM kernel classes: the preferred one routes inside FlashInfer (Renormalize, "
    "RenormalizeNaive, DeepSeekV3), the other two take the top-k from vLLM's router (any method; since 0.34.0 one "
    "for bf16 activations, TrtLlmMxfp4ExpertsModular, and one for MXFP8, TrtLlmMxfp4Mxfp8ExpertsModular)",
}


def _known_since_v33(v: str) -> dict[Key, str]:
    """The understood differences of vLLM ``v`` (0.33.0 or 0.34.0): the same facts in both
    releases (their probes differ only in the TRT-LLM kernel classes, which are not compared), so the
    same entries, each reason naming its release."""
    return {
        **_SHARED,
        ("routing_methods", "AITER_TRITON_MXFP4_BF16", "*"): (
            f"vLLM {v} also serves DeepSeekV3 routing with this kernel (AiterW4A16ExpertsMonolithic."
            "_supports_routing_method: aiter's routing with score_mode='sigmoid' and the correction bias, for "
            "MiMo-V2.6), and DeepseekV4, which is not a harness routing method. The adapter (kernels/aiter_common.py) "
            "routes with aiter's softmax routing only, so the declaration keeps Renormalize(Naive): claiming "
            "DeepSeekV3 would judge the kernel on routing it was not given. `select --routing DeepSeekV3` on ROCm "
            "refuses where vLLM picks it"
        ),
        ("routing_methods", "FLASHINFER_TRTLLM_MXFP4_BF16", "*"): (
            f"vLLM {v} has {_TRTLLM_CLASSES[v]}. The adapter calls FlashInfer's in-kernel routing only, so the "
            "declaration lists what that routing implements; MiniMax2, Sigmoid and SigmoidRenorm, which vLLM serves "
            "through the other classes, are not tested"
        ),
        ("routing_methods", "FLASHINFER_TRTLLM_MXFP4_MXFP8", "*"): "as FLASHINFER_TRTLLM_MXFP4_BF16",
        **_each("round_up", ("TRITON", "TRITON_UNFUSED"), ("gfx942", "gfx950"), _ROCM_256.format(v=v)),
    }


KNOWN_V34 = _known_since_v33(NEWEST_VLLM)
"""Understood differences from vLLM 0.34.0 (NEWEST_VLLM), the release the declarations and
``harness.upstream.selection`` follow: only limitations, each with why it stays (the adapters do not
implement a routing or an architecture vLLM has, a declaration has one alignment, the project's own
choices)."""
KNOWN_V33 = _known_since_v33(PREVIOUS_VLLM)
"""Understood differences from vLLM 0.33.0 (PREVIOUS_VLLM): the same limitations, none more (its
oracle answers as 0.34.0's in everything the check compares)."""

_PR50622 = (
    "vLLM 0.26.0 predates PR #50622, which added AITER_TRITON_MXFP4_BF16 (AITER's Triton W4A16 kernel): its enum "
    "member, the 'aiter_triton_mxfp4_bf16' string, its place in the GPT-OSS priority and in 'aiter'. The "
    "declarations follow 0.34.0, which has it (as 0.33.0 does)"
)
_NO_FALLBACK_V26 = (
    "vLLM 0.26.0's _filter_by_activation keeps only the variants of the asked-for activation quantization (and "
    "EMULATION), so a --moe-backend family with none of that scheme fails. 0.33.0 and 0.34.0, which the selection "
    "follows, then run the family's bf16 variant (with _warn_on_bf16_fallback's warning)"
)
_ROCM_256_V26 = (
    "On ROCm vLLM 0.26.0 pads TRITON and TRITON_UNFUSED to multiples of 256 "
    "(mxfp4_round_up_hidden_size_and_intermediate_size), as 0.33.0 and 0.34.0 do: a declaration has one pair of "
    "alignments "
    "for every architecture, and these follow vLLM on CUDA. The padding is zeros, so results agree; only the "
    "padding audit shows less padding than ROCm has"
)
_SM12X_V26 = (
    "vLLM 0.26.0 does not run the OpenAI Triton kernels on SM12x: its _triton_kernel_moe_supports_current_device "
    'keeps 9.0 <= capability < 11.0 on CUDA ("excludes SM120"). 0.33.0 widens it, and 0.34.0, which the '
    "declarations follow, keeps it, to < 13.0 with SM12x's own settings (mxfp4_utils._swizzle_mxfp4: "
    "is_persistent, epilogue_subtile=1; _constrain_sm12x_block_m: block_m at most 32), which the TRITON and "
    "TRITON_UNFUSED adapters apply there"
)
KNOWN_V26: dict[Key, str] = {
    **_SHARED,
    ("backends", "AITER_TRITON_MXFP4_BF16", "*"): _PR50622,
    ("gpt_oss_priority", "auto", "*"): _PR50622,
    ("gpt_oss_priority", "auto", "sm120"): (
        "vLLM 0.26.0 has one GPT-OSS priority order everywhere; on SM12x 0.33.0 and 0.34.0 move TRITON after MARLIN "
        "(0.34.0 on SM110 too), and the selection follows them. " + _PR50622
    ),
    ("moe_backend_strings", "aiter", "*"): _PR50622,
    ("moe_backend_strings", "aiter_triton_mxfp4_bf16", "*"): _PR50622,
    ("selection", "auto/none", "gfx942"): _PR50622 + ". Without it 0.26.0 falls to TRITON on gfx942",
    ("selection", "aiter/none", "gfx942"): _PR50622 + ". Without it 0.26.0's 'aiter' has nothing that takes gfx942",
    **_each(
        "selection",
        ("aiter/mxfp8", "aiter/fp8"),
        ("gfx942",),
        _NO_FALLBACK_V26 + ". " + _PR50622 + ", the bf16 variant that takes gfx942",
    ),
    **_each("selection", ("aiter/mxfp8",), ("gfx950",), _NO_FALLBACK_V26),
    **_each("selection", ("marlin/mxfp8", "marlin/fp8"), ("sm80", "sm90", "sm100", "sm120"), _NO_FALLBACK_V26),
    **_each("selection", ("flashinfer_cutlass/mxfp8", "flashinfer_cutlass/fp8"), ("sm90",), _NO_FALLBACK_V26),
    **_each("selection", ("flashinfer_trtllm/fp8",), ("sm100",), _NO_FALLBACK_V26),
    **_each(
        "selection",
        ("triton/mxfp8", "triton/fp8", "triton_unfused/mxfp8", "triton_unfused/fp8"),
        ("sm90", "sm100", "gfx942", "gfx950"),
        _NO_FALLBACK_V26,
    ),
    **_each("selection", ("triton/none", "triton/mxfp8", "triton/fp8"), ("sm120",), _SM12X_V26),
    **_each("selection", ("triton_unfused/none", "triton_unfused/mxfp8", "triton_unfused/fp8"), ("sm120",), _SM12X_V26),
    ("round_up", "FLASHINFER_TRTLLM_MXFP4_BF16", "*"): (
        "vLLM 0.26.0 pads the TRT-LLM intermediate size to a multiple of 256; 0.33.0 and 0.34.0, which the "
        "declarations follow, to 128 (mxfp4_round_up_hidden_size_and_intermediate_size)"
    ),
    ("round_up", "FLASHINFER_TRTLLM_MXFP4_MXFP8", "*"): "as FLASHINFER_TRTLLM_MXFP4_BF16",
    **_each("round_up", ("TRITON", "TRITON_UNFUSED"), ("gfx942", "gfx950"), _ROCM_256_V26),
    ("routing_methods", "FLASHINFER_TRTLLM_MXFP4_BF16", "*"): (
        "vLLM 0.26.0 has two TRT-LLM kernel classes: the preferred one routes inside FlashInfer (Renormalize and "
        "RenormalizeNaive only), the other takes the top-k from vLLM's router (any method). The adapter calls "
        "FlashInfer's in-kernel routing only, so the declaration lists what that routing implements"
    ),
    ("routing_methods", "FLASHINFER_TRTLLM_MXFP4_MXFP8", "*"): "as FLASHINFER_TRTLLM_MXFP4_BF16",
}
"""Understood differences from vLLM 0.26.0 (DEFAULT_VLLM, the release whose vendored triton_kernels
the Triton backends run), which the declarations no longer follow: where 0.26.0 differs from 0.34.0
(no PR #50622, no bf16 fallback, one priority order, the TRT-LLM round-up), and the limitations
both releases share."""

KNOWN_BY_VERSION: dict[str, dict[Key, str]] = {
    NEWEST_VLLM: KNOWN_V34,
    PREVIOUS_VLLM: KNOWN_V33,
    DEFAULT_VLLM: KNOWN_V26,
}
"""The understood differences of each vLLM release the drift check knows."""
KNOWN = KNOWN_BY_VERSION[NEWEST_VLLM]
"""Those of NEWEST_VLLM, the release the declarations follow (``vllm-drift``'s default)."""


def known_for(version: str = NEWEST_VLLM) -> dict[Key, str]:
    """KNOWN for VERSION: its own entries, or else those of the newest release listed before it
    (a newer vLLM is checked against the last reasons, and their staleness shows what changed)."""
    by_release = {release(v): known for v, known in KNOWN_BY_VERSION.items()}
    want = release(version)
    if want in by_release:
        return by_release[want]
    older = [r for r in by_release if r < want]
    return by_release[max(older)] if older else by_release[min(by_release)]


def vllm_root(version: str = DEFAULT_VLLM) -> Path:
    """The folder holding vLLM's extracted Python sources (``vllm/``)."""
    return cache_dir() / "vendor" / f"vllm-{version}"


def vllm_fetched(version: str = DEFAULT_VLLM) -> bool:
    """Whether ``fetch_vllm(version)`` has put both the sources and the probe's dependencies in the
    cache (the probe needs both)."""
    return (vllm_root(version) / "vllm" / "__init__.py").is_file() and deps_root(version).is_dir()


def deps_root(version: str = DEFAULT_VLLM) -> Path:
    """The folder holding the probe's pure-Python dependencies (``pip install --target``)."""
    return cache_dir() / "vendor" / f"vllm-{version}-deps"


def fetch_vllm(version: str = DEFAULT_VLLM, wheel: Path | None = None) -> Path:
    """Extract vLLM's Python sources (no compiled extension) from its wheel into the cache and
    install the probe's dependencies (``probe_deps(version)``) beside them; the sources' folder.
    The sources are put in place last, so that a failed install leaves the release unfetched."""
    import shutil

    wheel = wheel or download_vllm_wheel(version)
    root = vllm_root(version)
    tmp = root.with_name(root.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith("vllm/") and not n.endswith((".so", "/"))]
        if "vllm/__init__.py" not in names:
            raise VendorMissing(f"{wheel} is not a vLLM wheel (no vllm/__init__.py)")
        z.extractall(tmp, names)
    deps = deps_root(version)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(deps), "--upgrade", *probe_deps(version)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise VendorMissing(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)
    return root


def probe(arch: str, version: str = DEFAULT_VLLM, timeout: float = 300.0) -> dict:
    """vLLM's facts on ``arch`` (see ``harness.upstream.vllm_probe``), from a subprocess: the fake
    platform and vLLM's imports never reach this process."""
    root, deps = vllm_root(version), deps_root(version)
    if not (root / "vllm" / "__init__.py").is_file():
        raise VendorMissing(
            f"no vLLM {version} sources at {root}; run `python -m harness fetch vllm --vllm-version {version}`"
        )
    boot = (
        "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); sys.path.append(sys.argv.pop(1)); "
        "runpy.run_module('mxmoe.harness.upstream.vllm_probe', run_name='__main__', alter_sys=True)"
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
    version = str(facts.get("vllm_version") or NEWEST_VLLM)
    ours = {d.vllm_backend: d for d in declarations if d.vllm_backend}
    members = set(facts.get("backends", []))
    out: list[Drift] = []
    for name in sorted(set(ours) - members):
        out.append(Drift("backends", name, "*", "declared", "absent"))
    strings = facts.get("moe_backend_strings", {})
    for s, ours_list in MOE_BACKENDS.items():
        where = "*"
        if s == "auto":
            ours_list = gpt_oss_priority(arch) if arch in PROBE_ARCHS else GPT_OSS_PRIORITY
            where = "*" if ours_list == GPT_OSS_PRIORITY else arch  # an arch of its own order: its own row
            theirs_all = facts.get("gpt_oss_priority", [])
        elif s not in strings:
            out.append(Drift("moe_backend_strings", s, "*", ",".join(ours_list), "absent"))
            continue
        else:
            theirs_all = strings[s]
        if list(ours_list) != [m for m in theirs_all if m in ours]:
            kind = "gpt_oss_priority" if s == "auto" else "moe_backend_strings"
            out.append(Drift(kind, s, where, ",".join(ours_list), ",".join(theirs_all)))
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
        biases = facts.get("needs_biases", {}).get(name)
        mine = "required" if d.vllm_needs_biases else "optional"
        if biases in ("required", "optional") and biases != mine:
            out.append(Drift("needs_biases", name, "*", mine, biases))
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
    return [Drift(**{**asdict(d), "vllm_version": version}) for d in out]


def mark_known(drifts: list[Drift]) -> list[Drift]:
    """``drifts`` with the reason of each known one filled in, from the KNOWN of the release each came from."""
    marked = []
    for d in drifts:
        known = known_for(d.vllm_version)
        reason = known.get((d.kind, d.subject, d.arch)) or known.get((d.kind, d.subject, "*"))
        marked.append(Drift(**{**asdict(d), "known": reason}))
    return marked


def unique(drifts: list[Drift]) -> list[Drift]:
    """One row per (kind, subject, arch, ours, vllm): arch-independent facts repeat per probe."""
    seen, out = set(), []
    for d in drifts:
        key = (d.kind, d.subject, d.arch, d.ours, d.vllm, d.vllm_version)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def stale_known(drifts: list[Drift], version: str | None = None) -> list[Key]:
    """Entries of the release's KNOWN that no longer match any drift. The release is VERSION, else the
    one the drifts came from (NEWEST_VLLM when there are none: pass VERSION then)."""
    versions = {version} if version else {d.vllm_version for d in drifts} or {NEWEST_VLLM}
    stale: list[Key] = []
    for v in sorted(versions, key=release):
        mine = [d for d in drifts if d.vllm_version == v] if not version else drifts
        hit = {(d.kind, d.subject, d.arch) for d in mine} | {(d.kind, d.subject, "*") for d in mine}
        stale += [k for k in known_for(v) if k not in hit and k not in stale]
    return stale
