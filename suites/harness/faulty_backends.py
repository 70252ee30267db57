"""Backends that misbehave the way a sweep must survive, loaded by the tests with ``--backend-file``
(a file, not a module of the package: that is how an outside backend arrives). Each behaves
honestly except on the cases named, so the tests can show the sweep goes on after them."""

from __future__ import annotations

import os
import signal
import time

import torch

from mxmoe.harness.contract.backend import Arithmetic, BackendUnavailable, Declaration
from mxmoe.harness.contract.platforms import ARCHS
from mxmoe.harness.instruments.torch_moe import TorchMoE
from mxmoe.reference.moe import Precision

_FUSED = Arithmetic(precision=Precision(intermediate="bf16", output=torch.bfloat16))


def _declare(id_: str, description: str) -> Declaration:
    return Declaration(id=id_, archs=ARCHS, description=description, arithmetic=_FUSED)


class CrashFp32(TorchMoE):
    """Exits its process at T=1 (as a CUDA illegal memory access ends it) and segfaults at T=7."""

    declaration = _declare("crash-fp32", "os._exit(3) at T=1, SIGSEGV at T=7")

    def run(self, prepared, inputs, out):
        if inputs.case.tokens == 1:
            os._exit(3)
        if inputs.case.tokens == 7:
            os.kill(os.getpid(), signal.SIGSEGV)
        super().run(prepared, inputs, out)


class HangFp32(TorchMoE):
    """Never returns at T=1 (a deadlocked kernel)."""

    declaration = _declare("hang-fp32", "sleeps for ten minutes at T=1")

    def run(self, prepared, inputs, out):
        if inputs.case.tokens == 1:
            time.sleep(600)
        super().run(prepared, inputs, out)


class WrongSignFp32(TorchMoE):
    """Returns the layer's negation: every nonzero element is out of bounds."""

    declaration = _declare("wrongsign-fp32", "negated output")

    def run(self, prepared, inputs, out):
        super().run(prepared, inputs, out)
        out.neg_()


class WhereRan(TorchMoE):
    """Honest; appends ``backend case pid`` to the file named by $MXMOE_TEST_WHERE_RAN for every case
    it runs, so a test can see which worker process ran what."""

    declaration = _declare("where-ran-a", "honest fp32, noting its worker's pid")

    def run(self, prepared, inputs, out):
        with open(os.environ["MXMOE_TEST_WHERE_RAN"], "a", encoding="utf-8") as f:
            f.write(f"{self.declaration.id} {inputs.case.id} {os.getpid()}\n")
        super().run(prepared, inputs, out)


class WhereRanB(WhereRan):
    """The same, under another id: a second backend of every case."""

    declaration = _declare("where-ran-b", "honest fp32, noting its worker's pid")


def _company(path: str, others: set[str]) -> bool:
    """Whether a case of ``others`` has started (in any process: while one waits here, its own
    process starts nothing else)."""
    with open(path, encoding="utf-8") as f:
        lines = [line.split() for line in f]
    return any(w == "start" and case in others for w, case, _t, _pid in lines)


class Occupies(TorchMoE):
    """Honest, and slow: each run sleeps 0.2 s between two lines ``start|end case time pid`` it
    appends to $MXMOE_TEST_WHERE_RAN, so that a test sees which cases ran at the same time.

    $MXMOE_TEST_AWAIT_COMPANY names groups of cases (ids comma-separated, groups separated by
    ``;``). A case of one group also waits, after its start line, up to 60 s until a case of another
    group has started. The first of the groups' cases to start waits so for a case of another group
    in another worker; that one finds it waiting or running, and the two overlap whatever the order
    and speed of their workers. So whether they overlap depends on the sweep's admission alone,
    not on how fast the other workers start up. (A large case that waited only for some other case's
    start could find one long ended, and run with no small case beside it: so a GPU host's pr suite
    once failed.)"""

    declaration = _declare("occupies", "honest fp32, 0.2 s per run, noting when")

    def run(self, prepared, inputs, out):
        path = os.environ["MXMOE_TEST_WHERE_RAN"]
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"start {inputs.case.id} {time.time()} {os.getpid()}\n")
        time.sleep(0.2)
        groups = [set(filter(None, g.split(","))) for g in os.environ.get("MXMOE_TEST_AWAIT_COMPANY", "").split(";")]
        mine = any(inputs.case.id in g for g in groups)
        others = set().union(*(g for g in groups if inputs.case.id not in g)) if mine else set()
        deadline = time.monotonic() + 60
        while others and time.monotonic() < deadline and not _company(path, others):
            time.sleep(0.05)
        super().run(prepared, inputs, out)
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"end {inputs.case.id} {time.time()} {os.getpid()}\n")


class LoadsSlowly(Occupies):
    """``Occupies``, whose ``load`` takes 1.5 s the first time in a process (as vLLM's boot took 20 s
    a worker process on an H100) and then appends ``load pid time`` to $MXMOE_TEST_LOADS."""

    declaration = _declare("loads-slowly", "honest fp32, 0.2 s per run, 1.5 s to load once a process")
    _loaded = False

    def load(self):
        if not LoadsSlowly._loaded:
            time.sleep(1.5)
            with open(os.environ["MXMOE_TEST_LOADS"], "a", encoding="utf-8") as f:
                f.write(f"load {os.getpid()} {time.time()}\n")
            LoadsSlowly._loaded = True


class RefusesToLoad(Occupies):
    """``Occupies`` that never loads: each ``load`` appends ``refused pid time`` to $MXMOE_TEST_LOADS
    and raises BackendUnavailable, as a vendor backend whose package is missing does."""

    declaration = _declare("refuses-to-load", "raises BackendUnavailable from load")

    def load(self):
        with open(os.environ["MXMOE_TEST_LOADS"], "a", encoding="utf-8") as f:
            f.write(f"refused {os.getpid()} {time.time()}\n")
        raise BackendUnavailable("refuses to load: its package is missing here")


class CountsSiblings(Occupies):
    """``Occupies``, and also appends ``siblings case n`` to $MXMOE_TEST_SIBLINGS: the number of the
    sweep's other worker processes alive while it runs (its parent's children started by
    multiprocessing's spawn, read from Linux's /proc), the more of its counts as it begins and as
    it ends (a worker started while it ran counts)."""

    declaration = _declare("counts-siblings", "honest fp32, 0.2 s per run, counting the other workers")

    def run(self, prepared, inputs, out):
        before = len(_sibling_workers())
        super().run(prepared, inputs, out)
        with open(os.environ["MXMOE_TEST_SIBLINGS"], "a", encoding="utf-8") as f:
            f.write(f"siblings {inputs.case.id} {max(before, len(_sibling_workers()))}\n")


def _sibling_workers() -> list[int]:
    parent, me, found = os.getppid(), os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                spawned = b"spawn_main" in f.read()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == parent and spawned:
            found.append(int(entry))
    return found


class OutOfMemoryOnce(TorchMoE):
    """Honest, but raises torch's OutOfMemoryError the first time it meets each case, or the first
    $MXMOE_TEST_OOM_TIMES times (a count per case under $MXMOE_TEST_OOM_DIR), as a GPU shared with
    other workers can; appends ``case pid`` to $MXMOE_TEST_OOM_DIR/ran.txt for every call."""

    declaration = _declare("oom-once", "CUDA out of memory at each case's first call(s), honest after")

    def run(self, prepared, inputs, out):
        folder = os.environ["MXMOE_TEST_OOM_DIR"]
        with open(os.path.join(folder, "ran.txt"), "a", encoding="utf-8") as f:
            f.write(f"{inputs.case.id} {os.getpid()}\n")
        marker = os.path.join(folder, inputs.case.id)
        seen = int(open(marker).read()) if os.path.exists(marker) else 0
        if seen < int(os.environ.get("MXMOE_TEST_OOM_TIMES", "1")):
            with open(marker, "w") as f:
                f.write(str(seen + 1))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.91 GiB (a test's stand-in)")
        super().run(prepared, inputs, out)


KEPT: list[BaseException] = []
"""What ``KeepsAnError`` and ``KeepsTheLastError`` kept (a library's module-level memory of an error)."""


class KeepsAnError(TorchMoE):
    """Honest, but on each call raises and catches an error inside its run and keeps it at module
    level, as a library keeps a lazy import's failure or its first error for a later message: the
    kept traceback's frames reach the worker's."""

    declaration = _declare("keeps-an-error", "honest fp32, keeping an error caught inside its run")

    def run(self, prepared, inputs, out):
        try:
            raise LookupError("an optional module is absent (the library remembers why)")
        except LookupError as exc:
            KEPT.append(exc)
        super().run(prepared, inputs, out)


class KeepsTheLastError(KeepsAnError):
    """The same, but keeps only its latest error, as a library's "last error" does: each call
    drops the frames the one before kept, and keeps its own."""

    declaration = _declare("keeps-the-last-error", "honest fp32, keeping the latest error caught inside its run")

    def run(self, prepared, inputs, out):
        KEPT.clear()
        super().run(prepared, inputs, out)


class ConvertsPerLayer(TorchMoE):
    """Honest, declaring that its conversion reads only the layer (``converts_per_layer``), and
    counting its conversions: a sweep may keep them across a layer's cases."""

    declaration = _declare("converts-per-layer", "honest fp32, converting once per layer")
    converts_per_layer = True
    conversions = 0

    def convert(self, inputs):
        type(self).conversions += 1
        return super().convert(inputs)


class WritesWeightsPerLayer(ConvertsPerLayer):
    """The same, but writes into its input weights on every call (a kernel scribbling on what it
    was handed): the case that converts must catch it, and the next case convert again."""

    declaration = _declare("writes-weights-per-layer", "adds 1 to w2's first scale byte at each run")

    def run(self, prepared, inputs, out):
        super().run(prepared, inputs, out)
        inputs.weights.w2_scales.view(-1)[0] += 1


class DeclinesOnSeeing(TorchMoE):
    """Declines every case once it sees it (``BackendUnavailable`` from its conversion, as vLLM's
    oracle refusing a deployment does), its inputs untouched."""

    declaration = _declare("declines-on-seeing", "BackendUnavailable from convert")

    def convert(self, inputs):
        raise BackendUnavailable("this deployment is refused")


class DeclinesAfterWriting(DeclinesOnSeeing):
    """The same, having written into its input weights first."""

    declaration = _declare("declines-after-writing", "adds 1 to w2's first scale byte, then declines")

    def convert(self, inputs):
        inputs.weights.w2_scales.view(-1)[0] += 1
        super().convert(inputs)


class RaisesInRun(TorchMoE):
    """Raises from its kernel call on every case, its inputs untouched."""

    declaration = _declare("raises-in-run", "RuntimeError from run")

    def run(self, prepared, inputs, out):
        raise RuntimeError("a kernel launch failed")
