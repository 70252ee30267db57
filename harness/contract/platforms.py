"""Architectures and the host: which hardware a test needs, which this host has, and the host's
fingerprint that every result carries."""

from __future__ import annotations

import functools
import os
import platform
import socket
from importlib import metadata
from pathlib import Path

import torch

from mxmoe.harness.contract.cases import Case, make_case


def cache_dir() -> Path:
    """The project's cache of what is fetched, built or computed once (vendor code, wheels, builds,
    the weights' spectral norms): ``$MXMOE_CACHE`` if set, else ``.cache/`` of a source checkout
    (git-ignored), else ``~/.cache/mxmoe``."""
    env = os.environ.get("MXMOE_CACHE")
    if env:
        return Path(env).expanduser()
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "harness").is_dir():
        return checkout / ".cache"
    return Path.home() / ".cache" / "mxmoe"


ARCHS = ("cpu", "sm80", "sm90", "sm100", "sm120", "gfx942", "gfx950", "gfx1250")
"""Architecture tokens as they appear in test ids (``pytest -k gfx942``)."""

VENDOR_PACKAGES = (
    "torch",
    "triton",
    "pytorch-triton-rocm",
    "flashinfer-python",
    "amd-aiter",
    "aiter",
    "vllm",
    "triton_kernels",
    "safetensors",
)


def check_arch(arch: str) -> str:
    """Raise ValueError unless ``arch`` is one of ARCHS."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}; got {arch!r}")
    return arch


@functools.lru_cache(maxsize=1)
def host_arch() -> str:
    """This host's architecture token: the first GPU's, or ``cpu`` when torch sees none."""
    if not torch.cuda.is_available():
        return "cpu"
    if getattr(torch.version, "hip", None):
        return torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]  # e.g. gfx942
    major, minor = torch.cuda.get_device_capability(0)
    return f"sm{major}{minor}"  # sm90 for Hopper, sm100 for B200, sm86 for an A10


def use_triton_interpreter_without_gpu() -> None:
    """On a host with no GPU, Triton kernels can only run under Triton's interpreter, which must
    be chosen before triton is first imported (``triton.jit`` reads TRITON_INTERPRET when it
    decorates, its standard library included; torchao, for one, imports triton). The harness's
    entry points (CLI, pytest plugin) call this first; an explicit TRITON_INTERPRET is kept.

    It asks torch for a GPU rather than ``host_arch``, which tests replace to stand in for other
    hosts: the variable is process-wide and ``triton.jit`` reads it once per kernel, so a test
    standing in for a CPU host on a GPU machine would otherwise leave every Triton kernel its
    process imports afterwards interpreted (vLLM's routing kernel then raised)."""
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def pin_gpu(index: int) -> str | None:
    """Make GPU ``index`` (modulo the visible count) this process's current device, so that every
    "cuda" tensor, kernel launch and Triton compile of the process goes there: one worker per GPU
    (pytest-xdist workers, ``check --workers``, distributed ranks). ROCm's torch answers through
    ``torch.cuda`` as well. Returns what was pinned, or None on a host without GPUs."""
    import torch

    if not torch.cuda.is_available():
        return None
    device = index % torch.cuda.device_count()
    torch.cuda.set_device(device)
    return f"cuda:{device} ({torch.cuda.get_device_name(device)})"


CONVERTED_GPU_GIB = 12
"""GPU memory a check worker keeps converted weights in, across the cases of one layer
(``sweep._Converted``): a gpt-oss-120b layer converted for one backend is about 1.6 GiB, so an H200
worker keeps the eight production kernels' of one layer."""
WORKER_GPU_GIB = 28 + CONVERTED_GPU_GIB
"""GPU memory a check worker is given for a gpt-oss-120b case (the heaviest layer a sign-off
checks) before any test of its layer has shown what it takes, the unit ``case_gpu_gib`` scales
from; ``sweep._Needs`` admits with the larger of this and ``PEAK_MARGIN`` times the largest peak
shown. So it is a floor as well as a first guess, and a floor above what the tests take keeps
other cases off the GPU for nothing: at 48 + 12 GiB (a count from an H200 on 2026-12-03, before
the records named what a test holds) an H100's share (71 GiB) ran nothing of weight beside a
gpt-oss-120b case. Measured on an H100 (2026-12-07): the tests of a worker's first gpt-oss-120b
case (T=4096) took at most 32.7 GiB allocated, every backend's conversion kept
(``CONVERTED_GPU_GIB``'s part) and 2.0 GiB of the systematic test's w2 in float32 included, which is
kept in bfloat16 now; ``PEAK_MARGIN`` times the 30.7 GiB left is 38. Later cases took up to 40
GiB, 6 to 10 of it an earlier case's inputs and oracle that frames kept by a library held (a
record's ``held: other``; cleared after each test since, ``sweep.clear_frames_kept_below``); the
peaks shown admit those. At 28 + 12 (with the guards' and w2's savings) a sign-off on an H100 ran
gpt-oss-20b cases beside gpt-oss-120b ones for 212 s of its 466 s sweep; its kernel check took
472 s, 524 before."""
DEVICE_SHARE = 0.9
"""The part of a GPU's free memory (when a sweep starts) its cases may hold at once: the rest is
for what runs beside a sign-off's kernel check (the fault catalogue, the padding audit, GPQA's
tiny model) and each worker's CUDA context, which no allocator counts."""
PEAK_MARGIN = 1.25
"""Over the largest device memory a sweep's tests of one layer size were seen to take
(``device_peak_gib``, torch's allocated peak), what its later cases of that size are admitted with
where that is more than ``case_gpu_gib`` says (``sweep._Needs``): the allocator's cached blocks and
fragmentation on top of what it counts as allocated."""
WORKER_CPUS = 4
"""Host cores a GPU check worker is given, for ``auto_workers``: it draws on the GPU but runs its
backends' Python, its guards, Triton's compilations and its result on the host, and a worker
starved of cores stalls its GPU share."""


UNIT_TOKENS = 4128
"""The most tokens of the cases ``WORKER_GPU_GIB`` was measured on (gpt-oss-120b's balanced case,
one token over a block of 128 per expert): what tokens up to that many take is inside the unit."""
ROUTED_TOKEN_BYTES = 1 << 19
"""Device bytes a check takes per routed token (a token times its top-k) past ``UNIT_TOKENS``, at
gpt-oss's hidden and intermediate sizes (2880 each). Measured here on a CPU, where the engine
allocates as on a GPU (its batches are sized by element counts, not by the device): one check of
a gpt-oss-20b layer cut to 4 experts grew by 3.8 GiB from T=2048 to T=4096 (1.9 GiB a thousand
tokens, 0.47 MiB a routed token, here rounded up to 0.5); on an H200 (2026-12-04), the allocated
peaks of gpt-oss-20b tests grew by 3 to 9 GiB from T=257 to T=4095, by backend. Counted by its
weights alone, a long prefill case (gpt-oss-20b at T=16384: 15 GiB) would be admitted with less
than half of what it takes."""


def weights_gpu_gib(case: Case) -> float:
    """``WORKER_GPU_GIB`` scaled by the case's weight elements against gpt-oss-120b's: what a check
    of the layer holds with up to ``UNIT_TOKENS`` tokens (the draws, copies and conversions of its
    weights, the oracle's and the systematic test's batches sized by them)."""
    return WORKER_GPU_GIB * case.weight_elements / make_case("gptoss120b", 1).weight_elements


def tokens_gpu_gib(case: Case) -> float:
    """What the case's tokens past ``UNIT_TOKENS`` add (GiB): ``ROUTED_TOKEN_BYTES`` a routed token,
    scaled by the layer's hidden plus intermediate size against gpt-oss's (a small layer's rows are
    small). 0 for every case of ``UNIT_TOKENS`` tokens or fewer."""
    past = max(0, case.tokens - UNIT_TOKENS) * case.top_k
    return past * ROUTED_TOKEN_BYTES * (case.hidden + case.intermediate) / (2 * 2880) / (1 << 30)


def case_gpu_gib(case: Case) -> float:
    """Device memory one case's check may hold (GiB), for a sweep's admission of cases onto a GPU:
    its weights' part (``weights_gpu_gib``) and its tokens' past the unit's (``tokens_gpu_gib``), at
    least 1. A case larger than a GPU's share runs there alone."""
    return max(1.0, weights_gpu_gib(case) + tokens_gpu_gib(case))


def converted_gpu_gib(case: Case) -> float:
    """Device memory (GiB) a worker keeps its layer's converted weights in while on ``case``
    (``sweep._Converted``): the part of ``weights_gpu_gib`` that ``CONVERTED_GPU_GIB`` is of
    ``WORKER_GPU_GIB``, at most ``CONVERTED_GPU_GIB`` (12 GiB at gpt-oss-120b, 3 at -20b, 0.2 for
    the small layers), so that what a worker keeps stays inside what its case was admitted with.
    At a fixed 12 GiB instead, a worker on a gpt-oss-20b case could keep 12 GiB of conversions
    (with every tactic, 50 backends convert each 20b layer on an H200) where its admission counted 3.
    Its tokens do not count: the conversions are of the layer, the same for each of its cases."""
    return min(CONVERTED_GPU_GIB, max(1.0, weights_gpu_gib(case)) * CONVERTED_GPU_GIB / WORKER_GPU_GIB)


CONTEXT_GIB = 0.5
"""Device memory a process's CUDA context takes, which no allocator counts (on an H100, 2026-12-05,
each process that held nothing else showed 518 MiB in torch's out-of-memory message)."""


def free_device_memory() -> None:
    """Give what this process no longer uses back to its GPU: collect garbage first, since a
    backend's exception (an out-of-memory one above all) leaves its frames, and the tensors they
    hold, in reference cycles that only the collector frees and ``empty_cache`` cannot return.
    A full collection in a process that imported vLLM takes a noticeable fraction of a second, so
    callers do this after heavy work, not after every test."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


CACHE_KEPT_GIB = 1.0
"""Device memory (GiB) a worker's allocator may keep cached after a test: past it, a check worker
gives what is cached and unallocated back to the GPU before its next test (``return_cached``), and
a pytest worker collects garbage and gives its cache back before its share of the GPU goes
(``harness.plugin``); under it, the calls cost more than the memory is worth."""


def return_cached(slack_gib: float = CACHE_KEPT_GIB) -> bool:
    """Give the allocator's cached, unallocated blocks back to the GPU where they exceed
    ``slack_gib``; returns whether it did.

    Why: the sweep admits a case with what its tests were seen to allocate (``PEAK_MARGIN`` times
    their peak), but a process holds what its allocator reserved, and across the tests of one case
    that can grow past the allocated peak: blocks one backend's conversion freed can stay cached,
    in sizes the next backend's tensors may not fit. On an H100 (2026-12-07), vLLM's FlashInfer
    layer, the last of eight backends on a gpt-oss-120b case, had 45 GiB in use when it ran out of
    memory beside another case, where that layer's tests of up to 4128 tokens allocated at most
    33.2 GiB; every gpt-oss-120b case was admitted with 56 GiB after it, and none could run beside
    gpt-oss-20b's. Only past the slack, so that the many small tests keep their cache (an emptied
    cache sends the next test's allocations to the driver)."""
    if not torch.cuda.is_available():
        return False
    if torch.cuda.memory_reserved() - torch.cuda.memory_allocated() <= slack_gib * (1 << 30):
        return False
    torch.cuda.empty_cache()
    return True


def says_out_of_memory(text: str) -> bool:
    """Whether an error's text is the device running out of memory: torch's OutOfMemoryError, the
    CUDA or HIP runtime's "out of memory" (a context that could not be created too), or a backend's
    own wrapped message. Other processes on the same GPU can cause it."""
    return "OutOfMemoryError" in text or "out of memory" in text.lower()


def gpu_share_gib() -> float | None:
    """``DEVICE_SHARE`` of the free memory of the fullest visible GPU (GiB), the most a sweep's
    cases hold at once on each GPU; None without GPUs (a CPU sweep admits by workers alone)."""
    if not torch.cuda.is_available():
        return None
    free = min(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
    return DEVICE_SHARE * free / (1 << 30)


def auto_workers(arch: str | None = None) -> int:
    """``check --workers auto``: on a CPU one worker per core (each a single-threaded interpreter,
    mostly); on GPUs, per GPU as many as the host's cores hold at ``WORKER_CPUS`` each, at least
    one (workers are pinned to GPUs round-robin: ``pin_gpu``). Memory does not set the count: the
    sweep admits a case onto a GPU only while the cases running there fit its share
    (``case_gpu_gib``), so that 4 workers on an H200 run two gpt-oss-120b cases at once, as 2
    workers did, and small cases beside them. Several workers on one GPU keep it busy while each
    spends most of a test on the host (Triton's first compilations, the backends' Python)."""
    import torch

    cpus = os.cpu_count() or 1
    if (arch or host_arch()) == "cpu" or not torch.cuda.is_available():
        return cpus
    gpus = torch.cuda.device_count()
    return gpus * max(1, cpus // gpus // WORKER_CPUS)


def device_for(arch: str) -> str:
    """The torch device a test of ``arch`` runs on."""
    return "cpu" if arch == "cpu" else "cuda"


@functools.lru_cache(maxsize=1)
def host_fingerprint() -> dict[str, object]:
    """What a result must say about where it ran: GPU, driver, library versions."""
    versions = {}
    for name in VENDOR_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    info: dict[str, object] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "arch": host_arch(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "packages": versions,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        try:
            import subprocess

            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    return info
