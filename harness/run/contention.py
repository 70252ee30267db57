"""Other work on the GPU while the race hunt calls a kernel: a companion process per GPU that loops
a device-to-device copy (or a matmul) whenever a worker on that GPU is in a hunted case's calls.

Why: a race shows when the kernel's timing changes, and a kernel that has its GPU to itself keeps
the same timing call after call. Measured on an H100 (2026-12-05, FlashInfer 0.6.14's SM90 grouped
GEMM, whose race is FlashInfer #5438; gpt-oss-120b at T=4096, 3 cases x 42 calls): alone, none of
126 calls differed from its case's first, nor any of the 804 calls of a whole sign-off's hunt;
beside a process looping a bf16 matmul, 3 of 126 did; beside a process looping a 2 GiB copy, 10 of
126; beside three more checks of the same kernel, 5% to 11% of each one's calls. A serving engine
runs the kernel beside other work (its other layers, other processes), so a hunt that makes no
company hunts under conditions no user has. The copy is the default: it found the most, at the
least cost in memory.

How: the process that runs the sweep starts one companion per GPU (``Companions``); each waits,
sleeping, until a flag file of a live worker is in its GPU's folder, and loops its work while one
is. A worker raises its flag around a hunted case's calls (``Contention.beside``), so the work the
hunt does not need (drawing the case, the oracle, judging) runs at full speed. Two processes on one
GPU without MPS take turns on it by time slices, and the kernel is preempted mid-flight; within one
process, a second stream's copy changed nothing there (not confirmed to have run).

What it cannot do: make every condition a race may need (another clock, another GPU model, MPS's
true sharing of SMs), or make the race's rate in a serving engine: the rate the hunt sees is the
rate under this company.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CONTENTIONS = {
    "copy": "a process looping a 1 GiB device-to-device copy on the same GPU",
    "matmul": "a process looping a bf16 8192x8192 matmul on the same GPU",
    "none": "no other work on the GPU",
}
"""What ``check --contention`` (and the policy's ``[races] contention``) accepts, and what each
makes beside a hunted kernel's calls."""
DEFAULT_CONTENTION = "copy"
COMPANION_GIB = 2.75
"""Device memory a companion holds: its CUDA context (about 0.5 GiB) and its work's tensors (two
1 GiB buffers, or three bf16 8192x8192 matrices); the sweep admits cases within that much less."""
START_SECONDS = 120.0
"""How long a companion may take to start (import torch, make its CUDA context, allocate)."""


def check_contention(kind: str, name: str = "--contention") -> str:
    """``kind`` if it is one of ``CONTENTIONS``, else a ValueError naming ``name`` and the accepted."""
    if kind not in CONTENTIONS:
        raise ValueError(f"{name}: {kind!r} is not a contention; accepted: {', '.join(CONTENTIONS)}")
    return kind


class CompanionFailed(RuntimeError):
    """A companion did not start: the hunt would claim company it does not have."""


@dataclass(frozen=True)
class Contention:
    """What a worker needs to raise its flag (crosses the process boundary): the contention and the
    folder of the companions' flags, one sub-folder per GPU."""

    kind: str
    flags: str

    @contextlib.contextmanager
    def beside(self, gpu: int) -> Iterator[str]:
        """The companion on ``gpu`` works while this is open; yields the contention, for the record."""
        flag = Path(self.flags) / f"gpu{gpu}" / f"active-{os.getpid()}"
        flag.touch()
        try:
            yield self.kind
        finally:
            flag.unlink(missing_ok=True)


class Companions:
    """One companion process per GPU for the sweep's lifetime (a context manager). Each must say
    it is ready within ``START_SECONDS``; one that does not fails the start with its stderr's end,
    so that no hunt claims company it did not have."""

    def __init__(self, kind: str, gpus: int) -> None:
        self.kind = check_contention(kind)
        self.gpus = gpus
        self.flags = ""
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> Contention:
        self.flags = tempfile.mkdtemp(prefix="mxmoe-contention-")
        try:
            for gpu in range(self.gpus):
                (Path(self.flags) / f"gpu{gpu}").mkdir()
                argv = [sys.executable, "-m", "mxmoe.harness.run.contention", self.kind, str(gpu), self.flags,
                        str(os.getpid())]  # fmt: skip
                self._procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            for gpu, proc in enumerate(self._procs):
                self._wait_ready(gpu, proc)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return Contention(self.kind, self.flags)

    def _wait_ready(self, gpu: int, proc: subprocess.Popen) -> None:
        ready = Path(self.flags) / f"gpu{gpu}" / "ready"
        end = time.monotonic() + START_SECONDS
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > end:
                proc.kill()
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                tail = [line for line in err.splitlines() if line.strip()][-1:]
                raise CompanionFailed(f"the race hunt's companion ({self.kind}) on cuda:{gpu} did not start"
                                   + (f": {tail[0].strip()}" if tail else f" within {START_SECONDS:g} s"))  # fmt: skip
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stderr:
                proc.stderr.close()
        self._procs = []
        if self.flags:
            shutil.rmtree(self.flags, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _flagged(folder: Path) -> bool:
    """Whether a live worker's flag is up in ``folder`` (a dead worker's is taken down)."""
    up = False
    for flag in folder.glob("active-*"):
        try:
            pid = int(flag.name.removeprefix("active-"))
        except ValueError:
            continue
        if _alive(pid):
            up = True
        else:
            flag.unlink(missing_ok=True)
    return up


def companion_main(kind: str, gpu: int, flags: str, parent: int) -> None:
    """A companion's loop: its work on ``gpu`` while a worker's flag is up, a short sleep while
    none is; it ends when ``parent`` (the sweep's process) is gone."""
    import torch

    torch.cuda.set_device(gpu)
    if kind == "copy":
        src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)

        def work() -> None:
            dst.copy_(src)
    else:
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(a)

        def work() -> None:
            torch.matmul(a, a, out=out)
    work()
    torch.cuda.synchronize()
    folder = Path(flags) / f"gpu{gpu}"
    (folder / "ready").write_text(f"{kind} {torch.cuda.get_device_name(gpu)}\n")
    checked = time.monotonic()
    while True:
        if time.monotonic() - checked > 1.0:
            if not _alive(parent):
                return
            checked = time.monotonic()
        if _flagged(folder):
            for _ in range(4):
                work()
            torch.cuda.synchronize()
        else:
            time.sleep(0.0005)


if __name__ == "__main__":
    companion_main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
