"""Device memory shared by peer processes that no parent schedules: pytest-xdist's workers.

``check``'s sweep admits cases onto a GPU from its parent process, which knows what each worker
holds (``sweep._Needs``). pytest-xdist's workers have no such parent: each takes its next test
itself. On one H100 (2026-12-05) ``pytest suites/ --profile pr -n auto`` started 16 workers on the
one GPU; gpt-oss-20b's tests take about 17 GiB each, several ran at once, and every worker kept
what its allocator had cached after its last test, until the GPU was full: 18 tests failed, most of
them tests that start processes of their own, whose CUDA context could not even be created.

So each worker takes a share of its GPU before a test and gives it back after, through a ledger:
one JSON file per GPU, shared by one pytest run's workers and locked with ``fcntl.flock`` while it
is read and written. It holds, per process, the GiB its test holds or waits for. A request is
granted when what is held, what the requests older than it wait for, and its own need fit the
budget; or when nothing is held and none waits before it, so a need over the budget runs alone.
Counting the older requests' needs is what keeps a large request (a gpt-oss case, or a test
running again alone) from waiting forever behind a stream of small ones. A process that died
(a kernel fault ends an xdist worker) has its entry dropped the next time any process reads the
file. The needs are estimates (``platforms.case_gpu_gib``); what they miss, a test that runs out
of memory beside others shows, and the plugin runs such a test again alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

POLL_S = 0.1
"""How often a waiting request reads the ledger again."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that number: alive, not ours to judge
        return True
    return True


def run_folder(run_id: str) -> Path:
    """The folder of one pytest run's ledgers, in the system's temporary folder."""
    return Path(tempfile.gettempdir()) / f"mxmoe-ledger-{run_id}"


def remove_run(run_id: str) -> None:
    """Remove one pytest run's ledgers once no worker of it is left, so that a GPU runner's
    temporary folder does not gain a folder with every run of the suite (the run's controller
    calls this as it ends; a run killed before then leaves its folder)."""
    shutil.rmtree(run_folder(run_id), ignore_errors=True)


@dataclass(frozen=True)
class Ledger:
    """One GPU's ledger (module docstring): ``path`` the shared file, ``budget_gib`` what the
    shares held at once may add up to."""

    path: Path
    budget_gib: float

    @staticmethod
    def for_run(run_id: str, gpu: int, budget_gib: float) -> Ledger:
        """The ledger of GPU ``gpu`` for the pytest run ``run_id`` (xdist's ``testrunuid``, the same
        in every worker of one run and new in each run), in ``run_folder(run_id)``."""
        folder = run_folder(run_id)
        folder.mkdir(parents=True, exist_ok=True)
        return Ledger(folder / f"gpu{gpu}.json", budget_gib)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, dict[str, float]]]:
        """The ledger's entries by pid (``gib``, ``ticket``, ``held``), read and written under the
        file's lock, the entries of dead processes dropped."""
        with open(self.path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                f.seek(0)
                text = f.read()
                data = json.loads(text) if text.strip() else {"next": 0, "entries": {}}
                data["entries"] = {p: e for p, e in data["entries"].items() if _alive(int(p))}
                yield data
                f.seek(0)
                f.truncate()
                f.write(json.dumps(data))
                f.flush()
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _try(self, pid: str, gib: float) -> bool:
        """Register (once) or re-check this process's request; True once it is granted."""
        with self._locked() as data:
            entries = data["entries"]
            mine = entries.get(pid)
            if mine is None:
                mine = entries[pid] = {"gib": gib, "ticket": data["next"], "held": False}
                data["next"] += 1
            held = sum(e["gib"] for p, e in entries.items() if e["held"] and p != pid)
            before = [e for p, e in entries.items() if not e["held"] and e["ticket"] < mine["ticket"]]
            waited = sum(e["gib"] for e in before)
            if held + waited + gib <= self.budget_gib or (held == 0 and not before):
                mine["held"] = True
            return bool(mine["held"])

    def _drop(self, pid: str) -> None:
        with self._locked() as data:
            data["entries"].pop(pid, None)

    @contextlib.contextmanager
    def hold(self, gib: float) -> Iterator[float]:
        """Wait for a share of ``gib`` GiB, hold it through the block, give it back; yields the
        seconds waited. A process holds one share at a time."""
        pid, start = str(os.getpid()), time.monotonic()
        try:
            while not self._try(pid, gib):
                time.sleep(POLL_S)
            yield time.monotonic() - start
        finally:
            self._drop(pid)

    def alone(self) -> contextlib.AbstractContextManager[float]:
        """Hold the whole GPU: granted once every share held before it is given back."""
        return self.hold(max(self.budget_gib, 0.0) + 1.0)

    def holders(self) -> dict[int, float]:
        """The shares held now, by pid (for tests and reports)."""
        with self._locked() as data:
            return {int(p): e["gib"] for p, e in data["entries"].items() if e["held"]}
