"""Starting a distributed check: one spawned process per rank, a file store to meet at, a time
limit, and a verdict that survives any rank's death.

The parent decides what needs no process (the backend does not apply to the ranks' shards, the
host is another architecture or has too few GPUs (arch ``cpu``, gloo ranks on the CPU, runs on any
host), the backend does not load: SKIP, with the
reason) and is the only writer of results, as in ``sweep``: a rank killed by a kernel fault, or a
check that outlives its time, is that check's ERROR, with the exit codes, and the next check runs.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import tempfile
import time
from pathlib import Path

import torch

from mxmoe.harness.contract.backend import BackendUnavailable
from mxmoe.harness.contract.inputs import make_inputs
from mxmoe.harness.contract.platforms import host_arch
from mxmoe.harness.distributed.shard import Plan, tp_rank_inputs
from mxmoe.harness.judge.engine import Metrics, Result, test_id
from mxmoe.harness.run.registry import Loaded

STARTUP_GRACE = 120.0
"""Seconds the ranks may take to start (import torch, meet at the store) on top of the timeout."""


def dist_test_id(backend_id: str, arch: str, plan: Plan) -> str:
    """``backend-arch-case-tp4`` (with ``-fault-NAME`` for a planted fault)."""
    return f"{test_id(backend_id, arch, plan.case)}-{plan.suffix}"


def _skip_reason(loaded: Loaded, plan: Plan, arch: str) -> str | None:
    backend = loaded.backend
    d = backend.declaration
    if arch != host_arch() and arch != "cpu":  # every host has CPUs: gloo ranks run on any
        return f"needs {arch} hardware; this host is {host_arch()}"
    if arch != "cpu":
        have = torch.cuda.device_count()
        if have < plan.world:
            return f"needs {plan.world} GPUs, this host has {have}"
    if plan.mode == "ep" and not d.expert_parallel:
        return f"{d.id} does not declare expert parallelism"
    if plan.mode == "tp":  # every rank's layer must be one the backend runs (the partition width)
        shard = tp_rank_inputs(make_inputs(plan.case, "cpu"), plan, 0, planted=False).case
        reason = backend.supports(shard, arch)
    else:
        reason = backend.supports(dataclasses.replace(plan.case, ep=plan.world), arch)
    if reason:
        return reason
    try:
        backend.load()
    except (ImportError, BackendUnavailable) as exc:
        return f"{d.id} cannot run here: {exc}"
    return None


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def run_dist(loaded: Loaded, plan: Plan, arch: str, timeout: float = 600.0) -> Result:
    """The verdict of ``plan`` for ``loaded`` on ``arch`` (see the module docstring)."""
    d = loaded.backend.declaration
    tid = dist_test_id(d.id, arch, plan)
    result = Result(tid, d.id, arch, plan.case, "SKIP")
    start = time.perf_counter()
    reason = _skip_reason(loaded, plan, arch)
    if reason:
        result.reason = reason
        return result
    ctx = multiprocessing.get_context("spawn")
    from mxmoe.harness.distributed.rank import rank_main

    with tempfile.TemporaryDirectory(prefix="mxmoe-dist-") as tmp:
        job = {"backend_spec": loaded.spec, "case": plan.case.to_dict(), "mode": plan.mode, "world": plan.world,
               "fault": plan.fault, "arch": arch, "test_id": tid, "timeout": timeout,
               "store": str(Path(tmp) / "store"), "out": str(Path(tmp) / "verdict.json")}  # fmt: skip
        procs = [ctx.Process(target=rank_main, args=(r, job), name=f"mxmoe-rank{r}") for r in range(plan.world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout + STARTUP_GRACE
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):  # one died: the others wait forever
                time.sleep(1.0)  # let a rank that is merely slow to notice exit by itself
                break
            time.sleep(0.05)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        for p in procs:
            p.join()
        out = Path(job["out"])
        result.seconds = time.perf_counter() - start
        codes = ", ".join(f"rank {r}: {_exit_text(p.exitcode)}" for r, p in enumerate(procs))
        if all(p.exitcode == 0 for p in procs) and out.is_file():
            got = json.loads(out.read_text(encoding="utf-8"))
            from mxmoe.harness.run.results import from_json

            got = from_json(got)
            result.outcome, result.reason, result.traceback = got["outcome"], got["reason"], got["traceback"]
            if got["metrics"]:
                result.metrics = Metrics(**got["metrics"])
            return result
        result.outcome = "ERROR"
        if alive and time.monotonic() >= deadline:
            result.reason = f"timed out after {timeout:g} s ({codes})"
        else:
            result.reason = f"a rank process died ({codes})"
        return result
