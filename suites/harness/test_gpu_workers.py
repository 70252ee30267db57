"""One worker per GPU: xdist workers and ``check`` workers pinned to their GPU, and a worker killed
mid-run by a kernel fault costs that case an ERROR and no other result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mxmoe.harness.contract import platforms

ROOT = Path(__file__).resolve().parents[2]


def test_workers_are_pinned_to_gpus_round_robin(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"GPU{i}")
    assert [platforms.pin_gpu(i) for i in range(5)] == ["cuda:0 (GPU0)", "cuda:1 (GPU1)", "cuda:0 (GPU0)",
                                                         "cuda:1 (GPU1)", "cuda:0 (GPU0)"]  # fmt: skip
    assert chosen == [0, 1, 0, 1, 0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert platforms.pin_gpu(0) is None  # a CPU host: nothing to pin


def test_xdist_loses_no_result_when_a_worker_is_killed_mid_run(tmp_path):
    """crash-fp32 ends its process at T=1 (os._exit, as an illegal memory access does) and
    segfaults at T=7; under -n 2 both workers die mid-run and are replaced."""
    from mxmoe.harness.contract.platforms import host_arch

    results = tmp_path / "results"
    arch = host_arch()
    cmd = [sys.executable, "-m", "pytest", "suites/engine/test_differential.py", "-n", "2", "-p", "no:cacheprovider",
           "-q", "--backend", "crash-fp32", "--backend-file", "suites/harness/faulty_backends.py:CrashFp32",
           "-k", f"crash-fp32-{arch}-tiny", "--results", str(results)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 failed, 8 passed" in proc.stdout, proc.stdout[-3000:]
    records = [json.loads(line) for f in results.glob("results-*.jsonl") for line in f.read_text().splitlines()]
    by_id = {r["test_id"]: r for r in records}
    assert len(records) == len(by_id) == 10  # every test once: none lost, none twice
    crashed = {t: r for t, r in by_id.items() if r["outcome"] != "PASS"}
    assert sorted(crashed) == [f"crash-fp32-{arch}-tiny-interleaved-t1", f"crash-fp32-{arch}-tiny-interleaved-t7"]
    assert all(r["outcome"] == "ERROR" and "worker running it died" in r["reason"] for r in crashed.values())
    assert len({r["host"]["hostname"] for r in records}) == 1 and len(list(results.glob("results-*.jsonl"))) >= 3


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs (CUDA or ROCm) on this host")
@pytest.mark.parametrize("runner", ["xdist", "check"])
def test_each_worker_runs_on_its_own_gpu(runner, tmp_path):
    """-n auto (xdist workers pinned to GPUs round-robin) and check --workers N: every GPU is used, each worker
    process stays on one GPU."""
    from mxmoe.harness.contract.platforms import host_arch

    n = torch.cuda.device_count()
    log = tmp_path / "devices.log"
    probe = "suites/harness/device_probe_backend.py:DeviceProbe"
    k = f"device-probe-{host_arch()}-small"
    if runner == "xdist":
        cmd = [sys.executable, "-m", "pytest", "suites/engine/test_differential.py", "-n", "auto", "-q",
               "-p", "no:cacheprovider", "--backend", "device-probe", "--backend-file", probe, "-k", k]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "harness", "check", "--backend", "device-probe", "--backend-file", probe,
               "-k", k, "--workers", str(n), "--results", str(tmp_path / "results")]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")} | {"MXMOE_DEVICE_LOG": str(log)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = [line.split() for line in log.read_text().splitlines()]
    by_pid: dict[str, set[str]] = {}
    for pid, device in seen:
        by_pid.setdefault(pid, set()).add(device)
    assert all(len(devices) == 1 for devices in by_pid.values()), by_pid  # a worker stays on its GPU
    assert {d for devices in by_pid.values() for d in devices} == {f"cuda:{i}" for i in range(n)}, by_pid
