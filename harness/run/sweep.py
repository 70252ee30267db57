"""The sweep behind ``python -m harness check``: many (backend, case) pairs, each judged by
``run_case`` in a worker PROCESS, so that a backend that kills its process (a segfault, an illegal
memory access, ``os._exit``) or never returns costs one ERROR, not the sweep.

The parent owns the only ``Recorder``: it sends a worker one ``(backend spec, case dict, arch)``
task at a time, so when the worker dies or overruns its time the parent knows which case did it,
records that case as ERROR (with the exit code or signal, or the seconds waited), saves the case's
inputs as a reproducer (made in the parent: inputs are a pure function of the case), starts a fresh
worker and goes on. A worker handles many cases and keeps its loaded backends, so a healthy sweep
pays for a process start once per worker. Cases a backend does not support, or that need other
hardware, are decided in the parent (``supports`` is pure), without a worker.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import multiprocessing
import os
import re
import signal
import statistics
import sys
import time
import types
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, is_dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TextIO

from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.inputs import CaseInputs, make_inputs
from mxmoe.harness.contract.platforms import (
    PEAK_MARGIN,
    case_gpu_gib,
    converted_gpu_gib,
    device_for,
    free_device_memory,
    host_arch,
    return_cached,
    says_out_of_memory,
    tokens_gpu_gib,
)
from mxmoe.harness.judge.bounds import tie_aware_bound
from mxmoe.harness.judge.engine import OUTCOMES, Diagnose, Result, StageClock, run_case, test_id, timed
from mxmoe.harness.judge.systematic import kept_for
from mxmoe.harness.run.contention import Contention
from mxmoe.harness.run.registry import Loaded, load_spec
from mxmoe.harness.run.results import Recorder, save_repro

STARTUP_GRACE = 300.0
"""Seconds a fresh worker may take to start (import torch, initialise a GPU) on top of the timeout."""


@dataclass
class Verdict:
    """One finished pair: the result, the backend it came from and its reproducer (if any)."""

    result: Result
    loaded: Loaded
    repro: Path | None = None


def _repro_or_note(directory: Path, result: Result, loaded: Loaded, inputs: object | None) -> Path | None:
    """Save a reproducer for a FAIL or ERROR; a failure to save becomes a finding, never a crash."""
    if result.outcome not in ("FAIL", "ERROR"):
        return None
    try:
        if inputs is None:
            inputs = make_inputs(result.case, device_for(result.arch))
        return save_repro(directory, result, inputs, loaded.spec)
    except Exception as exc:  # the verdict matters more than its reproducer
        result.findings.append(f"no reproducer saved: {type(exc).__name__}: {exc}")
        return None


@dataclass
class _Shared:
    """One case's inputs and, per declared arithmetic, its oracle and bound (``tie_aware_bound``):
    what every backend checked on that case reads and none may change. Inputs are a pure function
    of the case and the oracle a pure function of the inputs and the arithmetic, so computing them
    once per case instead of once per backend changes no verdict and no number; it is most of a
    test's cost at gpt-oss shapes. Only the last case is kept (a sweep orders its pairs case by
    case), and a backend that writes into its inputs (the engine compares them bit for bit after
    every check) makes the next backend draw them again."""

    key: tuple[str, str] | None = None
    inputs: CaseInputs | None = None
    bounds: dict[object, tuple[object, int]] = field(default_factory=dict)

    def get(
        self, case: Case, arch: str, arithmetic: object, clock: StageClock | None
    ) -> tuple[CaseInputs, object, int]:
        if self.key != (case.id, arch):
            self.clear()
            with timed(clock, "inputs"):
                self.inputs = make_inputs(case, device_for(arch))
            self.key = (case.id, arch)
        if arithmetic not in self.bounds:
            with timed(clock, "oracle and bound"):
                self.bounds[arithmetic] = tie_aware_bound(self.inputs, arithmetic)
        bounded, tied = self.bounds[arithmetic]
        return self.inputs, bounded, tied

    def clear(self) -> None:
        self.key, self.inputs, self.bounds = None, None, {}


_SHARED = _Shared()


@dataclass
class _Converted:
    """Converted weights of the backends that ``converts_per_layer``, kept by a worker across the
    cases of one layer (``Case.conversion_key``) instead of converted again at each: at gpt-oss
    shapes a vLLM layer's conversion is most of its test's time, and the weights it converts are
    the same bytes for every token count. The case that converts is judged with every guard (a
    kernel that writes into its weights is caught there: the engine compares every input bit for
    bit), and a backend whose check raised, declined or modified its inputs loses what it kept.
    Only the current layer's are kept (``keep_layer``: the sweep hands a worker a layer's cases one
    after another, and memory a worker holds for a layer it has left is memory no admission counts),
    within ``budget`` bytes of device memory, measured around each conversion
    (``torch.cuda.memory_allocated``, hence on CUDA only); one that does not fit is not kept (every
    backend of a case converts in the same order at each case: evicting one to keep the next would
    convert them all at every case)."""

    budget: int | None = None
    """Bytes kept per layer; None: ``platforms.converted_gpu_gib`` of the layer's case, inside the
    memory the sweep admitted the case with."""
    kept: dict[tuple[str, Case], tuple[object, int]] = field(default_factory=dict)
    """(backend spec, conversion key) -> (converted weights, their bytes), oldest first."""
    meter: Callable[[object], int | None] | None = None
    """Bytes allocated on a device so far, or None where they cannot be measured (default: CUDA's
    ``memory_allocated``; a test's stand-in measures a CPU)."""

    def prepared(self, loaded: Loaded, case: Case) -> Callable[[CaseInputs], object] | None:
        """``run_case``'s ``prepared`` for this backend and case, or None to convert as usual."""
        if not loaded.backend.converts_per_layer:
            return None
        key = (loaded.spec, case.conversion_key)

        def convert(inputs: CaseInputs) -> object:
            if key in self.kept:
                return self.kept[key][0]
            meter = self.meter or _cuda_allocated
            before = meter(inputs.x.device)
            ready = loaded.backend.convert(inputs)
            after = meter(inputs.x.device)
            if before is not None and after is not None:
                budget = int(converted_gpu_gib(case) * (1 << 30)) if self.budget is None else self.budget
                self._keep(key, ready, max(0, after - before), budget)
            return ready

        return convert

    def keep_layer(self, layer: Case) -> None:
        """Forget what was converted for any layer but ``layer`` (a ``Case.conversion_key``): the
        worker has moved on to a case of ``layer``."""
        for key in [k for k in self.kept if k[1] != layer]:
            del self.kept[key]

    def kept_bytes(self) -> int:
        """Device bytes of what is kept, as measured at each conversion."""
        return sum(size for _, size in self.kept.values())

    def _keep(self, key: tuple[str, Case], ready: object, size: int, budget: int) -> None:
        self.keep_layer(key[1])
        if self.kept_bytes() + size <= budget:
            self.kept[key] = (ready, size)

    def clear(self) -> None:
        """Forget every layer's conversions (the worker is idle between cases: ``RELEASE``)."""
        self.kept.clear()

    def drop(self, spec: str) -> None:
        """Forget what backend ``spec`` kept (its check raised, declined or wrote into its inputs)."""
        for key in [k for k in self.kept if k[0] == spec]:
            del self.kept[key]


def _cuda_allocated(device: object) -> int | None:
    import torch

    dev = torch.device(device)
    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None


_CONVERTED = _Converted()


def check_pair(
    loaded: Loaded,
    case: Case,
    arch: str,
    *,
    diagnose: Diagnose | None = None,
    clock: StageClock | None = None,
    repeat: int = 0,
    contend: Callable[[], contextlib.AbstractContextManager[str]] | None = None,
) -> tuple[Result, CaseInputs | None]:
    """What a worker does with one task: ``run_case``, on the case's inputs and oracle shared with
    the backends checked on the same case before it (``_Shared``) and, for a backend that converts
    per layer, the weights it converted for an earlier case of the layer (``_Converted``).
    ``bench-check`` times this same function (``clock``), so that what it measures is what a
    sweep pays."""
    backend = loaded.backend
    inputs = bounded = None
    tied = 0
    try:
        if backend.supports(case, arch) is None and arch == host_arch():
            inputs, bounded, tied = _SHARED.get(case, arch, backend.declaration.arithmetic, clock)
    except Exception:  # run_case makes them again, and reports the harness's own failure as its ERROR
        _SHARED.clear()
        inputs = bounded = None
        tied = 0
    result, used = run_case(backend, case, arch, inputs=inputs, bounded=bounded, tied=tied,
                            prepared=_CONVERTED.prepared(loaded, case), diagnose=diagnose, clock=clock,
                            repeat=repeat, contend=contend)  # fmt: skip
    if result.inputs_modified or (used is not None and not result.inputs_checked):
        # written into, or not known to be unchanged: drawn again (unchanged after a backend that
        # raised or declined once it saw the case, they and their oracle stay for the next backend)
        _SHARED.clear()
    if result.inputs_modified or (used is not None and result.outcome not in ("PASS", "FAIL")):
        # its conversion wrote into them, or the backend raised or declined mid-call: converted again
        _CONVERTED.drop(loaded.spec)
    return result, used


def preload(cache: dict[str, Loaded], specs: tuple[str, ...]) -> bool:
    """Load ``specs``' backends into the worker's ``cache`` and run their ``load`` (vLLM's boot: about
    20 s a worker process on an H100), so that the worker's later cases do not pay it inside their
    tests. The sweep asks it of a worker held back for memory, whose time would otherwise go unused.
    False where a load raised: the worker then ends, so that a fresh process loads that backend
    inside its first test and records what it raises (a second import after a failed one can fail
    otherwise, half of the package already imported); the sweep starts it again and preloads no
    more."""
    for spec in specs:
        loaded = cache.get(spec)
        if loaded is None:
            loaded = cache[spec] = load_spec(spec)
        try:
            loaded.backend.load()
        except Exception:  # its own test's load says why, in a fresh process
            return False
    return True


PEAK_PART_GIB = 0.01
"""The least raise of a test's device peak its record names a stage for (``peak_parts``)."""


def tensor_bytes(*roots: object) -> int:
    """Bytes of the distinct tensor storages reachable from ``roots`` through dataclass fields
    (and what an instance caches in its ``__dict__``), dicts, lists and tuples. A view shares its
    base's storage, which counts once."""
    import torch

    storages: set[tuple[str, int]] = set()
    visited: set[int] = set()
    total, stack = 0, list(roots)
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if (str(obj.device), storage.data_ptr()) not in storages:
                storages.add((str(obj.device), storage.data_ptr()))
                total += storage.nbytes()
        elif id(obj) not in visited:
            visited.add(id(obj))
            if is_dataclass(obj) and not isinstance(obj, type):
                stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else
                             (getattr(obj, f.name) for f in fields(obj)))  # fmt: skip
            elif isinstance(obj, dict):
                stack.extend(obj.values())
            elif isinstance(obj, (list, tuple)):
                stack.extend(obj)
    return total


def held_parts(held_gib: float) -> dict[str, float]:
    """What a worker held when a test began (``held_gib``, allocated), in parts: ``held:
    conversions``, its layer's converted weights kept across cases (``_Converted``); ``held: case``,
    its case's shared inputs, oracle and bounds, and what the systematic test keeps of the inputs'
    w2 (``_Shared``); ``held: other``, the rest (the backends' own state, e.g. their workspaces, and
    anything no one let go). Admission decides how many cases share a GPU by such memory, so a
    record that says which part grew says what to cut."""
    gib = 1 << 30
    conversions = _CONVERTED.kept_bytes() / gib
    case = 0.0
    if _SHARED.inputs is not None:
        case = tensor_bytes(_SHARED.inputs, _SHARED.bounds, kept_for(_SHARED.inputs.weights)) / gib
    other = max(0.0, held_gib - conversions - case)
    return {"held: conversions": round(conversions, 3), "held: case": round(case, 3), "held: other": round(other, 3)}


def peak_parts(clock: StageClock, held: dict[str, float], peak_gib: float) -> dict[str, float]:
    """``Result.device_peak_parts``: the parts of what was allocated when the test began
    (``held_parts``), each stage that raised the peak by at least ``PEAK_PART_GIB``, and ``other``,
    the rest of ``peak_gib``."""
    parts = {name: gib for name, gib in held.items() if gib >= PEAK_PART_GIB}
    parts |= {name: round(v, 3) for name, v in clock.raised.items() if v >= PEAK_PART_GIB}
    parts["other"] = round(max(0.0, peak_gib - sum(held.values()) - sum(clock.raised.values())), 3)
    return parts


def stage_seconds(clock: StageClock, check_s: float, reproducer_s: float) -> dict[str, float]:
    """A test's time per stage for its record: ``clock``'s stages that took any time, ``other`` (the
    rest of ``check_s``, the check's wall time) and ``reproducer`` (saving a FAIL's or ERROR's)."""
    stages = {name: round(v, 4) for name, v in clock.seconds.items() if v > 0}
    stages["other"] = round(max(0.0, check_s - sum(clock.seconds.values())), 4)
    stages["reproducer"] = round(reproducer_s, 4)
    return stages


def leave_case(case: Case) -> None:
    """A worker moves on to ``case``: the last case's tensors go, and the allocator's cache with
    them, so that what a gpt-oss-120b case held (tens of GiB) is free for the other workers on its
    GPU; so do the conversions of a layer it has left. Not collected here: what outlived a test
    outside ``_SHARED`` and ``_CONVERTED`` was kept by a finished frame, not by a reference cycle
    (``clear_frames_kept_below``, after each test)."""
    import torch

    _SHARED.clear()
    _CONVERTED.keep_layer(case.conversion_key)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def clear_frames_kept_below(frame: types.FrameType) -> int:
    """Clear the locals of ``frame`` (finished) and of every finished frame whose callers reach it
    that something still keeps; returns how many were cleared.

    Why: a library that keeps an exception raised inside a test (a lazy import's caught error kept
    in a module, a first failure kept for a later message) keeps its traceback's frames, and a
    finished frame keeps its locals and its caller (``f_back``), up to the harness's own:
    ``check_pair``'s, ``run_case``'s and ``guarded_call``'s, which hold the case's inputs, its
    oracle and bound, and the backend's conversion. On an H100 (2026-12-07) every test of a worker
    after its first gpt-oss-120b case began with 9.75 GiB of that case allocated, and collecting
    garbage at each case switch freed none of it. Clearing a finished frame (what
    ``traceback.clear_frames`` does) drops only its locals: the kept exception still prints its
    traceback. An executing frame cannot be cleared and is left as it is. The collector's list of
    objects is walked, a fraction of a second where vLLM is imported, so the worker asks only where
    a frame of the test outlived it (``_checked``)."""
    import gc

    cleared = 0
    for obj in gc.get_objects():
        if type(obj) is not types.FrameType:
            continue
        caller = obj
        while caller is not None and caller is not frame:
            caller = caller.f_back
        if caller is None:
            continue
        with contextlib.suppress(RuntimeError):  # executing: not finished, left alone
            obj.clear()
            cleared += 1
    return cleared


def _checked(
    loaded: Loaded, case: Case, arch: str, **kwargs: object
) -> tuple[tuple[Result, CaseInputs | None], types.FrameType]:
    """``check_pair``, and the frame of this call, finished: a frame of the test that something
    kept keeps it as its caller, so a reference to it beyond the caller's own says that one outlived
    the test (``clear_frames_kept_below``). A new frame for each test, so a library that keeps only
    its latest error (the last test's frames, dropping the one before) is seen too, which a count of
    references to the worker's own frame, the same before and after such a test, would miss. The
    frame is taken after the call, not kept in a local: in a local it would keep itself."""
    return check_pair(loaded, case, arch, **kwargs), sys._getframe()  # type: ignore[arg-type]


def worker_main(
    conn: Connection,
    results_dir: str,
    threads: int,
    slot: int = 0,
    diagnose: Diagnose | None = None,
    contention: Contention | None = None,
) -> None:
    """A worker's loop: receive ``(index, spec, case dict, arch)``, answer ``("begin", index)`` at
    once and ``("done", index, Result, repro path)`` at the end; ``RELEASE`` frees what it holds of
    its last case, ``(PRELOAD, specs)`` loads backends ahead of their cases (``preload``), ``None``
    ends it. Backends are loaded once per spec and kept. Worker ``slot`` is
    pinned to GPU ``slot`` modulo their number (``platforms.pin_gpu``); its replacement after a
    crash takes the same GPU. ``diagnose`` (a module-level function, so that it crosses the process
    boundary) diagnoses each FAIL. ``contention``: the race hunt's company, which this worker calls
    up on its GPU around a hunted case's calls (``harness.run.contention``)."""
    import torch

    from mxmoe.harness.contract.platforms import pin_gpu

    torch.set_num_threads(max(1, threads))
    pin_gpu(slot)
    contend = None
    if contention is not None and torch.cuda.is_available():
        contend = functools.partial(contention.beside, torch.cuda.current_device())
    cache: dict[str, Loaded] = {}
    directory = Path(results_dir)
    case_id = None
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if task is None:
            return
        if task == RELEASE:
            _SHARED.clear()
            _CONVERTED.clear()
            case_id = None
            free_device_memory()
            continue
        if task[0] == PRELOAD:
            if not preload(cache, task[1]):
                return
            continue
        index, spec, case_dict, arch, repeat = task
        conn.send(("begin", index))
        case = Case.from_dict(case_dict)
        if case.id != case_id and torch.cuda.is_available():
            leave_case(case)
        case_id = case.id
        loaded = cache.get(spec)
        if loaded is None:
            loaded = cache[spec] = load_spec(spec)
        clock, start, held = StageClock(), time.perf_counter(), {}
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            held = held_parts(torch.cuda.memory_allocated() / (1 << 30))
        (result, inputs), test = _checked(loaded, case, arch, diagnose=diagnose, clock=clock, repeat=repeat,
                                          contend=contend)  # fmt: skip
        if sys.getrefcount(test) > 2:  # this name and the call's argument: more, a frame of the test outlived it
            clear_frames_kept_below(test)
        test = None
        if torch.cuda.is_available():
            peak = torch.cuda.max_memory_allocated() / (1 << 30)
            result.device_peak_gib = round(peak, 3)
            result.device_peak_parts = peak_parts(clock, held, peak)
        return_cached()  # what the test freed, cached past the slack, is not its case's next test's
        saving = time.perf_counter()
        repro = _repro_or_note(directory, result, loaded, inputs)
        # Not kept while the worker waits: an idle worker holding its last case's inputs (GiBs at
        # DeepSeek-V3) is memory no admission counts (``_SHARED`` keeps them for the case's next test).
        inputs = None
        result.stages = stage_seconds(clock, saving - start, time.perf_counter() - saving)
        if out_of_memory(result):
            # it leaves the case (the sweep queues it again): what it had, the case's inputs and
            # oracle included, goes back to its GPU's other workers now
            _SHARED.clear()
            free_device_memory()
        conn.send(("done", index, result, None if repro is None else str(repro)))


@dataclass
class _Needs:
    """Device memory (GiB) the sweep admits a case with: ``platforms.case_gpu_gib``, an estimate
    from the case's weights and tokens, or ``PEAK_MARGIN`` times what tests of the same model on
    weights of the same size (a shard's are smaller) have shown they take, whichever is more. What
    a test took is learned less its tokens' part (``platforms.tokens_gpu_gib``) and given back with
    the tokens of the case admitted: a long prefill case does not raise what the layer's decode
    cases are admitted with, and is admitted with its tokens on top of what they took. A test shows what it takes by the
    largest peak it recorded (``saw``), or by running out of memory beside other cases
    (``out_of_memory``). The sweep starts each layer's costliest cases first, so what they took is
    known before most of the layer's cases are admitted; but a peak is learned only from a test
    that finished, and the first cases of a size run on the estimate alone."""

    peaks: dict[tuple[str, int], float] = field(default_factory=dict)
    """Per model and weight size, the largest peak a test recorded, less its tokens' part."""
    raised: dict[tuple[str, int], float] = field(default_factory=dict)
    """Per model and weight size, what a test of that size running out of memory beside other cases
    showed it needs (``out_of_memory``), less its tokens' part."""

    def __call__(self, case: Case) -> float:
        key, tokens = (case.model, case.weight_elements), tokens_gpu_gib(case)
        shown = max(self.peaks.get(key, 0.0), self.raised.get(key, 0.0))
        return max(case_gpu_gib(case), PEAK_MARGIN * (shown + tokens) if shown else 0.0)

    def saw(self, result: Result) -> None:
        """Learn from a finished test (a run out of memory too: it took at least its peak)."""
        if result.device_peak_gib:
            case = result.case
            key = (case.model, case.weight_elements)
            self.peaks[key] = max(self.peaks.get(key, 0.0), result.device_peak_gib - tokens_gpu_gib(case))

    def out_of_memory(self, case: Case, took: float | None) -> float:
        """A test on ``case`` ran out of memory beside other cases, having taken ``took`` GiB with
        the allocation that failed (``took_gib``; None where its message does not say). The cases of
        its size are admitted with ``PEAK_MARGIN`` times that from now on where that is more (when
        it is not, the test was inside its admission and a neighbour took more than its own); where
        the message does not say, with twice what this one was (doubling reaches enough in a few
        steps, and a need over the GPU's share runs only where its GPU has no other case). Returns
        the need its size's cases of its tokens are admitted with now."""
        key = (case.model, case.weight_elements)
        shown = 2 * self(case) / PEAK_MARGIN if took is None else took
        self.raised[key] = max(self.raised.get(key, 0.0), shown - tokens_gpu_gib(case))
        return self(case)


def admission(needs: Iterable[float], room: float, share: float, before_head: float) -> int | None:
    """Where in the queue (``needs``: each queued case's memory, in queue order, the head first) an
    idle worker takes its next case, on a GPU with ``room`` GiB of its ``share`` left beside the
    cases running there, ``before_head`` GiB of which were admitted before the head began to wait;
    None: it waits.

    The head when it fits. Otherwise the first case that fits, which overtakes the head, but only
    while the head could not run even if the cases that overtook it ended: once what was running
    before it waited has ended, nothing more overtakes it, so it runs when those that did end. Why:
    with every idle worker taking the first case that fits, a large case could wait for as long as
    small ones were queued. On an H100 (2026-12-07) a gpt-oss-120b case, admitted with more memory
    after running out of it, waited about 95 s while gpt-oss-20b cases were taken in its place, and
    no gpt-oss-120b case ran meanwhile. A head larger than the share needs its GPU to itself."""
    queued = iter(needs)
    head = next(queued, None)
    if head is None:
        return None
    if head <= room:
        return 0
    if min(head, share) <= share - before_head:
        return None  # only cases that overtook it keep it out: they end, and it runs
    return next((n for n, need in enumerate(queued, start=1) if need <= room), None)


_TORCH_OUT_OF_MEMORY = re.compile(
    r"Tried to allocate ([\d.]+) (bytes|KiB|MiB|GiB)\..*?this process has ([\d.]+) (bytes|KiB|MiB|GiB) memory in use",
    re.S,
)
_UNIT_GIB = {"bytes": 1 / (1 << 30), "KiB": 1 / (1 << 20), "MiB": 1 / (1 << 10), "GiB": 1.0}


def took_gib(result: Result) -> float | None:
    """Device memory (GiB) a test that ran out of it had taken, counting the allocation that failed:
    torch's message says what its process had in use (its CUDA context and what other libraries
    allocated included) and what it tried to allocate. None where the message says neither (a
    backend's own wording, ROCm's older torch)."""
    found = _TORCH_OUT_OF_MEMORY.search(f"{result.reason or ''}\n{result.traceback or ''}")
    if found is None:
        return None
    asked, asked_unit, held, held_unit = found.groups()
    return float(asked) * _UNIT_GIB[asked_unit] + float(held) * _UNIT_GIB[held_unit]


@dataclass
class _Slot:
    """A worker process and the task it is running."""

    index: int = 0
    process: multiprocessing.process.BaseProcess | None = None
    conn: Connection | None = None
    task: int | None = None
    group: list[int] = field(default_factory=list)
    """The rest of the case this worker is on: its next tasks, before any other case's."""
    started: float = 0.0
    begun: bool = False
    deadline: float = 0.0
    gpu: int = 0
    """The GPU its worker is pinned to (``pin_gpu``: its index modulo their number)."""
    held: float = 0.0
    """Device memory (GiB) its case is admitted with (``case_gpu_gib``), while the case lasts."""
    admitted: int = 0
    """When its case was admitted, in the sweep's count of admissions (``admission``'s
    ``before_head``)."""
    spawned: float | None = None
    """When its worker was started, until its first test begins (start-up time)."""
    waiting: float | None = None
    """Since when it is idle with cases queued, none of which fits its GPU (held back)."""
    released: bool = True
    """Whether its worker was told to free its last case's memory (``RELEASE``) since its last test."""
    preloaded: bool = False
    """Whether its worker was asked to load the queued cases' backends while held back (``PRELOAD``)."""


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name} ({-code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Progress:
    """Counts of each outcome and done/total on stderr: one updating line on a terminal, a plain
    line every ``every`` seconds otherwise (CI logs)."""

    def __init__(self, total: int, stream: TextIO | None = None, every: float = 10.0) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = every
        self.counts: Counter[str] = Counter()
        self.out_of_memory = 0
        """Times a test ran out of GPU memory beside other cases so far (``Sweep.on_memory``), and
        ``alone`` the tests set aside to run again alone at the end: shown, so that a sweep's slow
        stretches are explained while it runs."""
        self.alone = 0
        self.last = time.monotonic()
        self.start = self.last
        self.printed = ""

    def line(self) -> str:
        done = sum(self.counts.values())
        parts = ", ".join(f"{self.counts[o]} {o}" for o in OUTCOMES if self.counts[o])
        if self.out_of_memory:
            parts += f"; out of memory beside others {self.out_of_memory} times"
            if self.alone:
                parts += f" ({self.alone} test{'s' * (self.alone != 1)} set aside to run alone at the end)"
        return f"check: {done}/{self.total} done ({parts or 'none yet'}) in {time.monotonic() - self.start:.0f} s"

    def add(self, outcome: str) -> None:
        self.counts[outcome] += 1
        self.tick()

    def memory(self, text: str, alone: bool) -> None:
        """A test ran out of memory beside other cases (``Sweep.on_memory``): counted, and ``text``
        (which test, what its GPU held, what happens to it) printed on a line of its own, so that a
        sweep's log names the cases whose admission fell short."""
        self.out_of_memory += 1
        self.alone += alone
        if self.tty:
            self.stream.write("\r\033[K")
        print(text, file=self.stream, flush=True)
        self.tick()

    def tick(self) -> None:
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r\033[K" + self.line())
            self.stream.flush()
        elif now - self.last >= self.every:
            self.last = now
            self.printed = self.line()
            print(self.printed, file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        if self.line() != self.printed:
            print(self.line(), file=self.stream, flush=True)


@dataclass
class Sweep:
    """Runs pairs in ``workers`` processes with a per-case ``timeout`` (seconds), recording each
    verdict through ``recorder`` as it arrives."""

    recorder: Recorder
    workers: int = 1
    timeout: float = 600.0
    on_verdict: Callable[[Verdict], None] | None = None
    diagnose: Diagnose | None = None
    """Gives each FAIL its diagnosis (``engine.Diagnose``; the CLI passes the catalogue's)."""
    gpu_gib: float | None = None
    """Device memory (GiB) the cases running on one GPU may hold together (``platforms.gpu_share_gib``):
    a worker takes the first queued case that fits beside its GPU's others
    (``platforms.case_gpu_gib``), past the queue's first only while that one could not run anyway
    (``admission``); one that fits nowhere runs where its GPU has no other; None (a CPU) admits
    every case."""
    gpus: int = 1
    """GPUs the workers are pinned to, round-robin (``platforms.pin_gpu``)."""
    repeat: Callable[[Loaded, Case], int] = lambda _loaded, _case: 0
    """The race hunt's repeats for a backend's test of a case (``engine.run_case``'s ``repeat``):
    ``check --repeat``, or the sign-off's policy for the backends it hunts races in
    (``races.hunt_plan``)."""
    contention: Contention | None = None
    """The race hunt's company on each GPU (``contention.Companions``, started by the caller), which a
    worker calls up around a hunted case's calls; None: the hunt's calls have the GPU to themselves."""
    on_memory: Callable[[str, bool], None] | None = None
    """Told of each test that ran out of GPU memory beside other workers: a line naming it, what
    its GPU held and what follows, and whether it is set aside to run again alone at the end (the
    second time) rather than put back in the queue, its case admitted with more memory (the first)."""
    verdicts: list[Verdict] = field(default_factory=list)
    times: Counter[str] = field(default_factory=Counter)
    """Where the workers' time went, in worker-seconds (``TIMES``), with ``wall`` the sweep's own:
    the benchmark of the sweep itself beside each test's ``stages``."""

    def _finish(self, verdict: Verdict) -> None:
        self.recorder.record(verdict.result, verdict.loaded, verdict.repro)
        self._recorded(verdict)

    def _recorded(self, verdict: Verdict) -> None:
        self.verdicts.append(verdict)
        if self.on_verdict:
            self.on_verdict(verdict)

    def _decide(self, pairs: list[tuple[Loaded, Case]], indices: list[int], arch: str) -> None:
        """Judge and record pairs decided without a worker (``_decided_here``), in one write."""
        done = []
        for i in indices:
            loaded, case = pairs[i]
            result, inputs = run_case(loaded.backend, case, arch)
            done.append(Verdict(result, loaded, _repro_or_note(self.recorder.directory, result, loaded, inputs)))
        self.recorder.record_many([(v.result, v.loaded, v.repro) for v in done])
        for verdict in done:
            self._recorded(verdict)

    def _decided_here(self, loaded: Loaded, case: Case, arch: str) -> bool:
        """Whether run_case would SKIP before loading the backend (cheap, no worker needed)."""
        try:
            return loaded.backend.supports(case, arch) is not None or arch != host_arch()
        except Exception:
            return False  # let the worker run it and record the exception

    def run(self, pairs: list[tuple[Loaded, Case]], arch: str) -> list[Verdict]:
        """Judge every pair on ``arch``; returns the verdicts in the order they finished."""
        directory = self.recorder.directory
        pending: list[int] = []
        decided: list[int] = []
        for i, (loaded, case) in enumerate(pairs):
            (decided if self._decided_here(loaded, case, arch) else pending).append(i)
        if not pending:
            for n in range(0, len(decided), DECIDED_BATCH):
                self._decide(pairs, decided[n : n + DECIDED_BATCH], arch)
            return self.verdicts
        ctx = multiprocessing.get_context("spawn")
        threads = max(1, (os.cpu_count() or 1) // max(1, self.workers))
        queue = by_case(pending, [case for _, case in pairs], heaviest_first=self.workers > 1)
        slots = [_Slot(index=i, gpu=i % max(1, self.gpus)) for i in range(min(self.workers, len(queue)))]
        began = time.monotonic()

        needs = _Needs()

        def need(group: list[int]) -> float:
            return needs(pairs[group[0]][1])

        def sharing(slot: _Slot) -> list[_Slot]:
            """The other slots on ``slot``'s GPU with a case under way (its memory admitted)."""
            return [s for s in slots if s is not slot and s.gpu == slot.gpu and (s.task is not None or s.group)]

        admissions = itertools.count(1)
        # per GPU, the queue's head when it was first refused there, and the count of admissions
        # then: the cases admitted since went past it (``admission``'s ``before_head``)
        head_waits: dict[int, tuple[list[int], int]] = {}

        def admit(slot: _Slot) -> int | None:
            """Where in the queue the idle ``slot`` takes its next case: the first when none runs on
            its GPU, else ``admission``'s pick beside the cases running there; None to wait."""
            if self.gpu_gib is None:
                return 0
            others = sharing(slot)
            if not others:
                return 0
            mark = head_waits.get(slot.gpu)
            if mark is None or mark[0] is not queue[0]:
                mark = head_waits[slot.gpu] = (queue[0], next(admissions))
            before = sum(s.held for s in others if s.admitted < mark[1])
            room = self.gpu_gib - sum(s.held for s in others)
            return admission((need(g) for g in queue), room, self.gpu_gib, before)

        def alone_on(gpu: int) -> bool:
            """Whether a case that fits nowhere beside others (``vacate``) is under way on ``gpu``.
            While it is, no worker held back there is started or preloads: a worker that has loaded
            backends holds memory no admission counts, and the cases it waits for wait anyway."""
            return self.gpu_gib is not None and any(
                s.gpu == gpu and (s.task is not None or s.group) and s.held > self.gpu_gib for s in slots
            )

        def stop_waiting(slot: _Slot) -> None:
            """The slot's wait for memory (if any) ends now: its time is held back."""
            if slot.waiting is not None:
                self.times["held back"] += time.monotonic() - slot.waiting
                slot.waiting = None

        def next_task(slot: _Slot) -> int | None:
            """The slot's case goes on where it is; an idle worker takes a queued case whole, the
            one that fits its GPU's memory (``admit``), or waits for one (None)."""
            if not slot.group and queue:
                pick = admit(slot)
                if pick is None:
                    slot.waiting = slot.waiting or time.monotonic()
                    return None
                stop_waiting(slot)
                slot.group = queue.pop(pick)
                slot.held = need(slot.group) if self.gpu_gib is not None else 0.0
                slot.admitted = next(admissions)
                if self.gpu_gib is not None and slot.held > self.gpu_gib:
                    vacate(slot)
            return slot.group.pop(0) if slot.group else None

        def vacate(slot: _Slot) -> None:
            """``slot`` takes a case that fits nowhere beside others (more than the GPU's share), so
            none runs on its GPU now: their workers, idle, still hold what no admission counts (the
            CUDA context, libraries' workspaces, their allocators' leftovers: 40 GiB and more after a
            quarter of an hour of tactics on an H200). They end, and ``slot``'s own worker starts
            afresh, so that the case has the GPU as a sweep of it alone would; the others start again
            with their next case. (``admit`` gave it the GPU only with no case under way there.)"""
            for other in slots:
                if other.gpu == slot.gpu and (other is slot or (other.task is None and not other.group)):
                    retire(other)

        def start(slot: _Slot) -> None:
            parent_conn, child_conn = ctx.Pipe()
            # Not a daemon: a backend may start processes of its own (daemons may not). A worker
            # whose parent disappears sees EOF on its pipe and exits.
            task = (child_conn, str(directory), threads, slot.index, self.diagnose, self.contention)
            proc = ctx.Process(target=worker_main, args=task, name="mxmoe-check")
            proc.start()
            child_conn.close()  # so that the worker's death shows as EOF here
            slot.process, slot.conn, slot.task = proc, parent_conn, None
            slot.spawned = time.monotonic()

        def stop(slot: _Slot) -> None:
            if slot.process is not None and slot.process.is_alive():
                slot.process.kill()
                slot.process.join(10)
            if slot.conn is not None:
                slot.conn.close()
            slot.process, slot.conn, slot.task, slot.preloaded = None, None, None, False

        def lost(slot: _Slot, reason: str) -> None:
            """The worker died or overran while on ``slot.task``: an ERROR for that case."""
            loaded, case = pairs[slot.task]
            d = loaded.backend.declaration
            result = Result(test_id(d.id, arch, case), d.id, arch, case, "ERROR", reason=reason)
            result.seconds = time.monotonic() - slot.started
            for xf in d.xfails:  # a known upstream crash is still the known failure
                if xf.matches(case):
                    result.outcome, result.reason = "XFAIL", f"{xf.reason} ({xf.link}): {reason}"
            stop(slot)
            self._finish(Verdict(result, loaded, _repro_or_note(directory, result, loaded, None)))

        def retire(slot: _Slot) -> None:
            """Ends the slot's worker: asked to finish where it is idle, killed otherwise."""
            if slot.process is not None and slot.process.is_alive() and slot.task is None:
                try:
                    slot.conn.send(None)
                    slot.process.join(5)
                except (BrokenPipeError, OSError):
                    pass
            stop(slot)

        # A test that ran out of GPU memory beside other workers says nothing of its backend. The
        # first time, it goes back to the front of the queue with the rest of its case, which its
        # worker leaves (each of them would convert its weights again and run out of memory in
        # turn), and the cases of its size are admitted with more memory from then on
        # (``_Needs.out_of_memory``); the second time, it runs again at the end, one worker alone on
        # its GPU, so that only a test that runs out of memory by itself is an ERROR.
        requeued: set[int] = set()
        retried: set[int] = set()
        preloading = True

        def preload_on(slot: _Slot) -> None:
            """``slot``'s worker, held back for memory, loads the queued cases' backends meanwhile
            (``PRELOAD``): on an H100 sign-off, workers waited 63% of their time while each of 7
            worker processes booted vLLM (20 s) inside a test, two of them inside gpt-oss-120b cases,
            which run one at a time there. A worker not yet started is started for it; its start-up
            is then time held back, not start-up before a test."""
            specs = tuple(dict.fromkeys(pairs[i][0].spec for group in queue for i in group))
            if slot.process is None or not slot.process.is_alive():
                stop(slot)
                start(slot)
                slot.spawned = None
            try:
                slot.conn.send((PRELOAD, specs))
            except (BrokenPipeError, OSError):
                stop(slot)
                return
            slot.preloaded = True

        def gone_idle(slot: _Slot) -> None:
            """``slot``'s worker is found dead before its next task began: one that preloaded ended on
            a backend's load that raised or crashed (``preload``), so no worker preloads again; it
            starts afresh with its next case."""
            nonlocal preloading
            if slot.preloaded:
                preloading = False
            stop(slot)

        def out_of_memory_beside_others(slot: _Slot, index: int, result: Result) -> None:
            case = pairs[index][1]
            others = sharing(slot)
            held = sum(s.held for s in others)
            before = slot.held
            took = took_gib(result)
            grown = needs.out_of_memory(case, took)
            set_aside = index in requeued
            (retried if set_aside else requeued).add(index)
            rest = ([] if set_aside else [index]) + slot.group
            if rest:
                queue.insert(0, rest)
            slot.group = []
            text = f"check: {result.test_id} ran out of GPU memory beside {len(others)} other case(s) on GPU {slot.gpu}"
            if self.gpu_gib is not None:
                peak = "" if took is None else f", and it took {took:.1f} with what it asked for"
                text += (f" (they were admitted with {held:.1f} of {self.gpu_gib:.0f} GiB, its case with {before:.1f}"
                         f"{peak}; its size's cases now with {grown:.1f})")  # fmt: skip
            text += "; set aside to run again alone at the end" if set_aside else "; back in the queue, its case whole"
            if self.on_memory:
                self.on_memory(text, set_aside)

        try:
            for alone in (False, True):
                if alone:
                    if not retried:
                        break
                    # one worker per GPU (slot i is pinned to GPU i modulo their number), each alone
                    # on its own: a multi-GPU host reruns them on all its GPUs, not on one
                    kept = max(1, min(self.gpus, len(slots)))
                    for slot in slots:  # the kept ones too: they start afresh, holding nothing of before
                        retire(slot)
                    slots = slots[:kept]
                    queue.extend([i] for i in sorted(retried))
                    where = "one worker alone" if kept == 1 else f"one worker alone on each of {kept} GPUs"
                    print(f"check: {len(retried)} test(s) ran out of GPU memory beside other workers twice; "
                          f"running them again, {where}", file=sys.stderr, flush=True)  # fmt: skip
                while queue or decided or any(s.task is not None or s.group for s in slots):
                    for slot in slots:
                        if slot.task is None and (slot.group or queue):
                            index = next_task(slot)
                            if index is None:
                                continue  # no queued case fits beside its GPU's others yet
                            if slot.process is None or not slot.process.is_alive():
                                gone_idle(slot)
                                start(slot)
                            loaded, case = pairs[index]
                            try:
                                slot.conn.send((index, loaded.spec, case.to_dict(), arch, self.repeat(loaded, case)))
                            except (BrokenPipeError, OSError):
                                slot.group.insert(0, index)  # the idle worker had died: restart it next round
                                gone_idle(slot)
                                continue
                            # Until the worker says it has begun, its start-up (importing torch) is
                            # not the backend's time.
                            slot.task, slot.started, slot.begun = index, time.monotonic(), False
                            slot.deadline = slot.started + self.timeout + STARTUP_GRACE
                            slot.released = False
                    for slot in slots:
                        if slot.task is None and not slot.group and not slot.released and slot.conn is not None:
                            # Idle between cases (held back for memory, or nothing left for it): what
                            # its worker still holds of its last case (inputs, oracle, conversions,
                            # the allocator's cache; tens of GiB at gpt-oss-120b) no admission counts.
                            slot.released = True
                            try:
                                slot.conn.send(RELEASE)
                            except (BrokenPipeError, OSError):
                                gone_idle(slot)  # started again with its next case
                    if preloading and queue:
                        for slot in slots:
                            idle = slot.waiting is not None and slot.task is None and not slot.group
                            if idle and not slot.preloaded and not alone_on(slot.gpu):
                                preload_on(slot)
                    if not queue:  # nothing left to hold back for
                        for slot in slots:
                            stop_waiting(slot)
                    if decided:
                        # The pairs decided here (a nightly's tens of thousands of SKIPs of other
                        # architectures) are recorded a batch at a time while the workers start
                        # and run, not before the first worker starts.
                        self._decide(pairs, decided[:DECIDED_BATCH], arch)
                        del decided[:DECIDED_BATCH]
                    busy = [s for s in slots if s.task is not None]
                    if not busy:
                        continue
                    wait_s = 0.0 if decided else min(1.0, max(0.0, min(s.deadline for s in busy) - time.monotonic()))
                    ready = set(wait([s.conn for s in busy] + [s.process.sentinel for s in busy], timeout=wait_s))
                    for slot in busy:
                        if slot.conn in ready or slot.process.sentinel in ready:
                            try:
                                while slot.task is not None and slot.conn.poll():
                                    message = slot.conn.recv()
                                    if message[0] == "begin":
                                        now = time.monotonic()
                                        if slot.spawned is not None:
                                            self.times["start-up"] += now - slot.spawned
                                            slot.spawned = None
                                        slot.started, slot.begun = now, True
                                        slot.deadline = slot.started + self.timeout
                                    else:
                                        _, index, result, repro = message
                                        slot.task = None
                                        self.times["tests"] += time.monotonic() - slot.started
                                        needs.saw(result)
                                        if len(slots) > 1 and index not in retried and out_of_memory(result):
                                            _forget_repro(repro)  # the rerun's verdict makes its own
                                            out_of_memory_beside_others(slot, index, result)
                                            continue
                                        self._finish(Verdict(result, pairs[index][0], repro and Path(repro)))
                            except (EOFError, OSError):
                                pass  # the worker is gone; its exit status says how
                            if slot.task is not None and not slot.process.is_alive():
                                slot.process.join(1)
                                if slot.preloaded and not slot.begun:
                                    # it ended in its preload, before this task began: the task
                                    # runs in a fresh worker, whose own load of it is the verdict's
                                    slot.group.insert(0, slot.task)
                                    slot.task = None
                                    gone_idle(slot)
                                else:
                                    lost(slot, f"the backend's process crashed: {_exit_text(slot.process.exitcode)}")
                        elif time.monotonic() > slot.deadline:
                            what = f"no verdict within {self.timeout:g} s" if slot.begun else "the worker did not start"
                            lost(slot, f"timeout: {what}; the worker was killed")
        finally:
            for slot in slots:
                retire(slot)
            self.times["wall"] += time.monotonic() - began
        return self.verdicts

    def time_line(self) -> str:
        """Where the sweep's worker time went, one line: its wall time, the workers' seconds in
        tests (from each test's start to its verdict in the parent), starting up, held back for
        device memory, and the rest (between tests, or idle at the end with nothing left)."""
        t = self.times
        if not t["wall"]:
            return "check: no test needed a worker"
        total = t["wall"] * self.workers
        rest = max(0.0, total - t["tests"] - t["start-up"] - t["held back"])
        parts = [f"{name} {t[name]:.0f} s ({100 * t[name] / total:.0f}%)" for name in TIMES[1:]]
        return (f"check: {self.workers} worker(s) x {t['wall']:.0f} s: " + ", ".join(parts)
                + f", between tests or idle {rest:.0f} s ({100 * rest / total:.0f}%)")  # fmt: skip

    def memory_line(self) -> str | None:
        """What set the device memory of the model whose tests took the most, one line: its tests'
        median and largest peak, and what the largest is made of (``Result.device_peak_parts``).
        Memory decides how many cases share a GPU, so this names what to cut where ``time_line``
        shows workers held back. None where no test recorded a peak (a CPU)."""
        peaked = [v.result for v in self.verdicts if v.result.device_peak_gib]
        if not peaked:
            return None
        top = max(peaked, key=lambda r: r.device_peak_gib)
        mine = [r.device_peak_gib for r in peaked if r.case.model == top.case.model]
        parts = sorted(top.device_peak_parts.items(), key=lambda kv: -kv[1])
        made = ", ".join(f"{name} {gib:.1f}" for name, gib in parts if gib >= 0.05) or "not recorded"
        return (f"check: device memory of {top.case.model}'s {len(mine)} tests: median peak "
                f"{statistics.median(mine):.1f} GiB, largest {top.device_peak_gib:.1f} GiB "
                f"({top.test_id}: {made})")  # fmt: skip


RELEASE = "release"
"""What the sweep tells an idle worker between cases (``worker_main``): free the last case's device
memory (its inputs and oracle, its layer's conversions, the allocator's cached blocks), which the
admission of other cases onto its GPU does not count once its case is over."""

PRELOAD = "preload"
"""What the sweep sends a worker held back for memory, with the backend specs its queued cases
need (``worker_main``, ``preload``): load them now rather than inside the worker's next tests."""

DECIDED_BATCH = 500
"""Pairs decided without a worker recorded per write (``Recorder.record_many``): well under 0.1 s
of the parent's time on a 2-core CPU (109,780 SKIPs in 20 s, start-up included), the longest a
worker's finished test waits for its record meanwhile."""

TIMES = ("wall", "tests", "start-up", "held back")
"""What ``Sweep.times`` counts: the sweep's wall time, then the workers' seconds in each."""


def _forget_repro(repro: str | None) -> None:
    """Remove a reproducer (its JSON and tensors) of an attempt whose verdict is not recorded."""
    if repro:
        for path in (Path(repro), Path(repro).with_suffix(".safetensors")):
            path.unlink(missing_ok=True)


def out_of_memory(result: Result) -> bool:
    """Whether an ERROR is the device running out of memory (torch's OutOfMemoryError, also as a
    backend's own wrapped message), which other workers on the same GPU can cause."""
    return result.outcome == "ERROR" and says_out_of_memory(f"{result.reason or ''}\n{result.traceback or ''}")


def case_cost(case: Case) -> int:
    """A case's work, for ordering only: its tokens' multiply-adds in both GEMMs plus its weights'
    size (drawing them, converting them for each backend, the norms behind the energy test)."""
    return case.experts * case.hidden * case.intermediate + case.tokens * case.top_k * case.hidden * case.intermediate


def by_case(indices: list[int], cases: list[Case], heaviest_first: bool = False) -> list[list[int]]:
    """``indices`` (into ``cases``) in groups of one case each, in first-seen order, each group in
    its own order. A worker takes a group whole, so one case's inputs and oracle are computed once
    for all its backends (``check_pair``) also when several workers share the sweep. With
    ``heaviest_first`` (more than one worker) the costliest layers start first, and within a layer
    its costliest cases, so that the sweep does not end waiting on one large case that started
    last (longest-processing-time order, by layer; the verdicts do not depend on the order)."""
    groups: dict[str, list[int]] = {}
    for i in indices:
        groups.setdefault(cases[i].id, []).append(i)
    out = list(groups.values())
    if heaviest_first:
        # layer by layer (the heaviest layer first, each case of it heaviest first), so that a
        # worker's next case is most often of the layer whose conversions it keeps (``_Converted``)
        layer_cost: Counter[Case] = Counter()
        first: dict[Case, int] = {}
        for n, g in enumerate(out):
            key = cases[g[0]].conversion_key
            layer_cost[key] += case_cost(cases[g[0]])
            first.setdefault(key, n)

        def order(g: list[int]) -> tuple[int, int, int]:
            key = cases[g[0]].conversion_key
            return (-layer_cost[key], first[key], -case_cost(cases[g[0]]))

        out.sort(key=order)  # stable: ties keep their order
    return out


def worst_ratio(verdicts: list[Verdict]) -> float:
    """The largest error/bound ratio among verdicts that compared numbers (0 when none did)."""
    ratios = [v.result.metrics.worst_ratio for v in verdicts if v.result.metrics.elements]
    ratios = [r for r in ratios if not math.isnan(r)]
    return max(ratios, default=0.0)
