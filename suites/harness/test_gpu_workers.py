"""One worker per GPU: xdist workers and ``check`` workers pinned to their GPU, and a worker killed
mid-run by a kernel fault costs that case an ERROR and no other result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from mxmoe.harness import platforms

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
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "pytest", "suites/engine/test_differential.py", "-n", "2", "-p", "no:cacheprovider",
           "-q", "--backend", "crash-fp32", "--backend-file", "suites/harness/faulty_backends.py:CrashFp32",
           "-k", "crash-fp32-cpu-tiny", "--results", str(results)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 failed, 8 passed" in proc.stdout, proc.stdout[-3000:]
    records = [json.loads(line) for f in results.glob("results-*.jsonl") for line in f.read_text().splitlines()]
    by_id = {r["test_id"]: r for r in records}
    assert len(records) == len(by_id) == 10  # every test once: none lost, none twice
    crashed = {t: r for t, r in by_id.items() if r["outcome"] != "PASS"}
    assert sorted(crashed) == ["crash-fp32-cpu-tiny-interleaved-t1", "crash-fp32-cpu-tiny-interleaved-t7"]
    assert all(r["outcome"] == "ERROR" and "worker running it died" in r["reason"] for r in crashed.values())
    assert len({r["host"]["hostname"] for r in records}) == 1 and len(list(results.glob("results-*.jsonl"))) >= 3
