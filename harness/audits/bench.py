"""Speed of the reference MoE layer at production shapes, next to a plain float64 matmul timed in
the same run: the oracle must be fast enough to check gpt-oss layers at T=4096 on one GPU, and
the matmul says what "fast" means on that device."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from mxmoe.harness.contract.cases import MODELS, Model
from mxmoe.harness.contract.inputs import generator_for, random_mxfp4_weights, tie_free_logits
from mxmoe.reference.moe import dequantize_weights, moe

MODEL_SHAPES = {name: MODELS[name] for name in ("gptoss20b", "gptoss120b")}
"""The production shapes the benchmark times (from the case zoo)."""


def gemm_flops(model: Model, tokens: int) -> int:
    """FLOPs of the two expert GEMMs of ``model`` over ``tokens`` tokens (2 per multiply-add)."""
    per_slot = 2 * (2 * model.intermediate * model.hidden + model.hidden * model.intermediate)
    return tokens * model.top_k * per_slot


def _timed(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up call."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_rate(device: str, n: int, repeats: int, dtype: torch.dtype = torch.float64) -> float:
    """FLOP/s of an n x n x n matmul in ``dtype`` on ``device`` (random data, not zeros)."""
    gen = generator_for("bench-matmul", device)
    a = torch.randn(n, n, generator=gen, device=device, dtype=torch.float64).to(dtype)
    b = torch.randn(n, n, generator=gen, device=device, dtype=torch.float64).to(dtype)
    return 2 * n**3 / _timed(lambda: a @ b, device, repeats)


def bench_reference(
    device: str, models: list[str], tokens: list[int], repeats: int, matmul_n: int
) -> tuple[float, list[dict[str, object]]]:
    """Time the reference layer for each model and token count; returns the same-run matmul
    FLOP/s and one row per (model, T)."""
    rate = matmul_rate(device, matmul_n, repeats)
    rows = []
    for name in models:
        shape = MODEL_SHAPES[name]
        gen = generator_for(f"bench-{name}", device)
        weights = random_mxfp4_weights(gen, shape.experts, shape.hidden, shape.intermediate, device=device)
        prepared = dequantize_weights(weights)
        for t in tokens:
            x = torch.randn(t, shape.hidden, generator=gen, device=device).to(torch.bfloat16)
            logits = tie_free_logits(gen, t, shape.experts, device)
            flops = gemm_flops(shape, t)
            row: dict[str, object] = {"model": name, "tokens": t, "matmul_tflops": rate / 1e12}
            # "packed": dequantization included, as for a one-off check; "prepared": weights
            # dequantized once (dequantize_weights) and shared by every case on that layer.
            for kind, w in (("packed", weights), ("prepared", prepared)):
                secs = _timed(lambda x=x, lg=logits, w=w, k=shape.top_k: moe(x, lg, w, top_k=k), device, repeats)
                row[f"{kind}_ms"] = secs * 1e3
                row[f"{kind}_tflops"] = flops / secs / 1e12
                row[f"{kind}_ratio"] = flops / secs / rate
            rows.append(row)
        del weights, prepared
    return rate, rows


def bench_backend(
    backend: object, arch: str, models: list[str], tokens: list[int], repeats: int, matmul_n: int
) -> tuple[float, list[dict[str, object]]]:
    """Time a backend's ``run`` (weights converted once, outside the timing) on the cases
    ``make_case(model, T)``; returns the same-run bf16 matmul FLOP/s (what a bf16 MoE kernel can
    at best approach) and one row per (model, T)."""
    from mxmoe.harness.contract.cases import make_case
    from mxmoe.harness.contract.inputs import make_inputs
    from mxmoe.harness.contract.platforms import device_for

    device = device_for(arch)
    rate = matmul_rate(device, matmul_n, repeats, torch.bfloat16)
    backend.load()
    rows = []
    for name in models:
        for t in tokens:
            case = make_case(name, t)
            inputs = make_inputs(case, device)
            prepared = backend.convert(inputs)
            out = torch.empty(t, case.hidden, dtype=backend.declaration.arithmetic.precision.output, device=device)
            secs = _timed(lambda p=prepared, i=inputs, o=out: backend.run(p, i, o), device, repeats)
            flops = gemm_flops(MODELS[name], t)
            rows.append(
                {
                    "model": name,
                    "tokens": t,
                    "ms": secs * 1e3,
                    "tflops": flops / secs / 1e12,
                    "ratio": flops / secs / rate,
                    "bf16_matmul_tflops": rate / 1e12,
                }
            )
            del inputs, prepared, out
    return rate, rows


def bench_check(
    pairs: list[tuple[object, object]],
    arch: str,
    directory: str,
    diagnose: Callable[..., str] | None = None,
    on_row: Callable[[dict[str, object]], None] | None = None,
) -> list[dict[str, object]]:
    """Time what a sweep pays for each (loaded backend, case) pair, in this process and in the
    sweep's order: every stage of the check (``engine.STAGES``, through ``sweep.check_pair``, the
    function a worker calls), recording the result and saving a reproducer into ``directory`` (as
    the sweep's parent does), and next to it the oracle alone on the same inputs (the exact layer,
    weights dequantized inside the call). The ratio of the two says how much of a test is the
    oracle's own arithmetic and how much is everything around it. ``diagnose`` is what the sweep
    gives a FAIL (the CLI passes the catalogue's); ``on_row`` sees each row as it is made."""
    from mxmoe.harness.judge.engine import STAGES, StageClock
    from mxmoe.harness.run.results import Recorder
    from mxmoe.harness.run.sweep import _repro_or_note, check_pair, stage_seconds

    sync = torch.cuda.synchronize if arch != "cpu" and torch.cuda.is_available() else (lambda: None)
    recorder = Recorder(directory)
    oracle_s: dict[str, float] = {}
    rows = []
    for loaded, case in pairs:
        clock = StageClock()
        start = time.perf_counter()
        result, inputs = check_pair(loaded, case, arch, diagnose=diagnose, clock=clock)
        check_s = time.perf_counter() - start
        t0 = time.perf_counter()
        repro = _repro_or_note(recorder.directory, result, loaded, inputs)
        recorder.record(result, loaded, repro)
        record_s = time.perf_counter() - t0
        if inputs is not None and case.id not in oracle_s:
            sync()
            t0 = time.perf_counter()
            inputs.reference()
            sync()
            oracle_s[case.id] = time.perf_counter() - t0
        oracle = oracle_s.get(case.id) if inputs is not None else None
        stages = dict.fromkeys(STAGES, 0.0) | stage_seconds(clock, check_s, record_s)
        total = check_s + record_s
        rows.append({
            "backend": loaded.backend.declaration.id,
            "case": case.id,
            "outcome": result.outcome,
            "seconds": total,
            "stages": stages,
            "oracle_seconds": oracle,
            "ratio": total / oracle if oracle else None,
        })  # fmt: skip
        if on_row is not None:
            on_row(rows[-1])
        del inputs, result
    return rows
