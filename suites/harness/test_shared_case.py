"""A sweep shares one case's inputs and oracle among the backends checked on it
(``sweep.check_pair``): the verdicts and every number must be those of checking each pair alone,
including after a backend that writes into its inputs."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from mxmoe.harness.contract.platforms import host_arch
from mxmoe.harness.judge import systematic
from mxmoe.harness.judge.engine import run_case
from mxmoe.harness.run.profiles import profile_cases
from mxmoe.harness.run.registry import load_spec
from mxmoe.harness.run.sweep import _SHARED, check_pair

ARCH = host_arch()
HERE = Path(__file__).resolve()
FAULTY = HERE.with_name("faulty_backends.py")
ENGINE = HERE.parents[1] / "engine" / "test_engine.py"
SPECS = (
    f"{ENGINE}:WritesX",  # first on each case: the shared inputs must be drawn again after it
    "mxmoe.harness.instruments.honest:HonestFp32",
    "mxmoe.harness.instruments.honest:HonestBf16Gemm",  # another arithmetic: its own oracle and bound
    "mxmoe.harness.instruments.honest:HonestSplitK",
    f"{FAULTY}:WrongSignFp32",
    "mxmoe.kernels.emulation:Emulation",
)
CASES = ("tiny-interleaved-default-t8", "small-interleaved-t16-trained", "tpsmall-interleaved-t9-tp2r1",
         "dsmini-chunked-t9-ep2r1", "small-interleaved-t16-neartie")  # fmt: skip


def _spans(log: Path) -> dict[str, list[float]]:
    """Each case's span in an ``Occupies`` log, from its first start to its last end line."""
    spans: dict[str, list[float]] = {}
    for _what, case, when, _pid in (line.split() for line in log.read_text().splitlines()):
        span = spans.setdefault(case, [math.inf, -math.inf])
        span[0], span[1] = min(span[0], float(when)), max(span[1], float(when))
    return spans


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def test_shared_inputs_and_oracle_change_no_verdict_and_no_number():
    loaded = [load_spec(s) for s in SPECS]
    cases = [c for c in profile_cases("pr") if c.id in CASES]
    assert len(cases) == len(CASES)
    _SHARED.clear()
    checked = 0
    for case in cases:  # case by case, as a sweep orders them
        for item in loaded:
            shared, _ = check_pair(item, case, ARCH)
            alone, _ = run_case(item.backend, case, ARCH)
            assert shared.outcome == alone.outcome, (shared.test_id, shared.reason, alone.reason)
            assert shared.reason == alone.reason
            assert shared.findings == alone.findings
            a, b = shared.metrics.to_dict(), alone.metrics.to_dict()
            assert all(_same(a[k], b[k]) for k in a), {k: (a[k], b[k]) for k in a if not _same(a[k], b[k])}
            checked += shared.outcome != "SKIP"
    assert checked >= 20
    outcomes = {(r.backend, r.outcome) for r in [check_pair(item, cases[0], ARCH)[0] for item in loaded]}
    expected = {("writes-x", "FAIL"), ("wrongsign-fp32", "FAIL"), ("honest-fp32", "PASS"), ("emulation", "PASS")}
    assert expected <= outcomes


def test_a_backend_that_raises_or_declines_keeps_the_cases_inputs_shared_unless_it_wrote_into_them():
    """After a backend that declined the case once it saw it (a SKIP) or raised (an ERROR), the
    inputs are compared as after any check: unchanged, the next backend is checked on the same
    inputs, oracle and bound, with the verdict and numbers of a check alone; written into, they are
    drawn again, and the verdicts are still those of checks alone."""
    from mxmoe.harness.judge.engine import StageClock

    honest = load_spec("mxmoe.harness.instruments.honest:HonestFp32")
    case = next(c for c in profile_cases("pr") if c.id == "tiny-interleaved-default-t8")
    alone, _ = run_case(honest.backend, case, ARCH)
    for spec, outcome, kept in (("DeclinesOnSeeing", "SKIP", True), ("RaisesInRun", "ERROR", True),
                                ("DeclinesAfterWriting", "SKIP", False)):  # fmt: skip
        _SHARED.clear()
        assert check_pair(honest, case, ARCH)[0].outcome == "PASS"
        inputs, bounds = _SHARED.inputs, dict(_SHARED.bounds)
        result, used = check_pair(load_spec(f"{FAULTY}:{spec}"), case, ARCH)
        assert result.outcome == outcome and used is inputs, (spec, result.reason)
        assert (_SHARED.inputs is inputs and _SHARED.bounds == bounds) if kept else _SHARED.inputs is None
        assert result.inputs_checked and result.inputs_modified == ([] if kept else ["w2_scales"])
        clock = StageClock()
        after, _ = check_pair(honest, case, ARCH, clock=clock)
        assert after.outcome == alone.outcome == "PASS" and after.metrics.to_dict() == alone.metrics.to_dict()
        drawn = {stage for stage in ("inputs", "oracle and bound") if clock.seconds[stage] > 0}
        assert drawn == (set() if kept else {"inputs", "oracle and bound"}), (spec, clock.seconds)
    _SHARED.clear()


def test_what_a_worker_holds_between_tests_is_split_into_conversions_case_and_the_rest(monkeypatch):
    """A record's held memory names its parts, so that a sweep held back for memory says what to
    cut: the layer's conversions kept across cases (their measured bytes), the case's shared inputs,
    oracle and bounds with what the systematic test keeps of its w2 (their tensors' bytes, a view
    counted with its base), and the rest of what was allocated. A worker on a CPU records none of
    this (no allocator to read); the parts are checked here from the shared state itself."""
    import dataclasses

    import torch

    from mxmoe.harness.run import sweep

    base = torch.zeros(1024, dtype=torch.float64)  # 8 KiB

    @dataclasses.dataclass(frozen=True)
    class Holder:
        whole: torch.Tensor
        view: torch.Tensor
        more: dict

    held = Holder(base, base[:10], {"a": [torch.zeros(256, dtype=torch.int32)], "b": (base.view(2, 512),)})
    assert sweep.tensor_bytes(held) == 8192 + 1024
    assert sweep.tensor_bytes(held, held, base) == 8192 + 1024
    assert sweep.tensor_bytes(None, 3, "x", {}) == 0

    honest = load_spec("mxmoe.harness.instruments.honest:HonestFp32")
    case = next(c for c in profile_cases("pr") if c.id == "tiny-interleaved-default-t8")
    _SHARED.clear()
    assert sweep.held_parts(2.0) == {"held: conversions": 0.0, "held: case": 0.0, "held: other": 2.0}
    assert check_pair(honest, case, ARCH)[0].outcome == "PASS"
    inputs = _SHARED.inputs
    w = inputs.weights
    own = sum(t.untyped_storage().nbytes() for t in (inputs.x, inputs.router_logits, w.w13_blocks, w.w13_scales,
                                                     w.w2_blocks, w.w2_scales, w.w13_bias, w.w2_bias))  # fmt: skip
    (bounded, _), = _SHARED.bounds.values()
    oracle = sum(t.untyped_storage().nbytes() for t in (bounded.ref, bounded.rigorous, bounded.probabilistic))
    case_bytes = sweep.tensor_bytes(_SHARED.inputs, _SHARED.bounds, systematic.kept_for(w))
    assert case_bytes >= own + oracle
    kept = sweep._Converted()
    kept.kept[("conv", case)] = (None, 3 << 29)  # 1.5 GiB measured at a conversion
    monkeypatch.setattr(sweep, "_CONVERTED", kept)
    gib = 1 << 30
    parts = sweep.held_parts(4.0)
    assert parts["held: conversions"] == 1.5
    assert parts["held: case"] == round(case_bytes / gib, 3)
    assert parts["held: other"] == round(4.0 - 1.5 - case_bytes / gib, 3)
    assert sweep.held_parts(0.5)["held: other"] == 0.0  # never negative, whatever the allocator said
    _SHARED.clear()


def test_spectral_norms_are_kept_on_disk(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("MXMOE_CACHE", str(tmp_path))
    gen = torch.Generator().manual_seed(7)
    blocks = torch.randint(0, 256, (64, 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(118, 125, (64, 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    systematic._NORMS.clear()
    first = systematic.w2_norm2(blocks, scales)
    files = [p for p in (tmp_path / "spectral-norms").rglob("*") if p.is_file() and p.suffix != ".lock"]
    assert len(files) == 1 and float(files[0].read_text()) == first
    systematic._NORMS.clear()
    files[0].write_text(repr(first * 2))  # read back, not recomputed
    assert systematic.w2_norm2(blocks, scales) == first * 2
    systematic._NORMS.clear()
    files[0].write_text("not a number")  # unreadable: computed again and rewritten
    assert systematic.w2_norm2(blocks, scales) == first
    assert float(files[0].read_text()) == first
    exact = float(torch.linalg.matrix_norm(systematic.dequantize_mxfp4(blocks, scales).double(), ord=2)) ** 2
    assert exact <= first <= exact * (1 + 3e-4)
    systematic._NORMS.clear()


def test_the_gpu_norm_bound_by_squaring_the_gram_matrix_is_an_upper_bound_and_tight():
    """``gram_power_bounds`` (the GPU's way, run here on the CPU): never below the exact squared
    norm, at most ``rank ** (1 / 2 ** (m + 1))`` above it where every singular value is the largest
    (its worst case), exact to its rounding allowance where the largest stands apart; 0 for a zero
    matrix."""
    import torch

    gen = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (3, 96, 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(118, 125, (3, 96, 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    w = systematic.dequantize_mxfp4(blocks, scales)  # [3, 96, 64]: the Gram matrix is 64 x 64
    q, _ = torch.linalg.qr(torch.randn(64, 64, generator=gen, dtype=torch.float64))
    flat = torch.cat([q * 3.0, torch.zeros(32, 64, dtype=torch.float64)])  # 64 equal singular values
    batch = torch.stack([*w, flat, torch.zeros(96, 64, dtype=torch.float64)])
    got = systematic.gram_power_bounds(batch)
    exact = torch.linalg.matrix_norm(batch, ord=2) ** 2
    worst = 64 ** (1 / 2 ** (systematic._SQUARINGS + 1)) * (1 + systematic._POWER_SLACK)
    assert bool((got >= exact).all()) and bool((got <= exact * worst).all()), (got, exact)
    assert got[-1] == 0 and got[3] > exact[3] * (1 + 1e-5)  # the worst case is reached, and allowed
    assert bool((got[:3] <= exact[:3] * (1 + 2 * systematic._POWER_SLACK)).all())
    # both ways bound the same norm, a few 1e-4 apart at most
    svd = torch.tensor(systematic.norm2_upper_bounds(list(w)), dtype=torch.float64)
    assert bool(((svd - got[:3]).abs() <= 3e-4 * exact[:3]).all())


def test_workers_on_the_same_weights_share_the_svds(tmp_path, monkeypatch):
    """A norm another process is computing (its digest's lock held) is not computed again: that
    expert is left for last and its result waited for, while the others are computed meanwhile."""
    import fcntl
    import threading

    import torch

    from mxmoe.reference.moe import MoEWeights

    monkeypatch.setenv("MXMOE_CACHE", str(tmp_path))
    gen = torch.Generator().manual_seed(11)
    blocks = torch.randint(0, 256, (3, 64, 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(118, 125, (3, 64, 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    w13_blocks = torch.zeros(3, 128, 32, dtype=torch.uint8)  # H = I = 64; w2 is what the norms read
    weights = MoEWeights(w13_blocks, torch.full((3, 128, 2), 127, dtype=torch.uint8), blocks, scales)
    systematic._NORMS.clear()
    path = tmp_path / "spectral-norms"
    key = systematic._digest(blocks[1], scales[1])
    (path / key[:2]).mkdir(parents=True)
    other = open(path / key[:2] / f"{key}.lock", "a+b")  # another worker, computing expert 1's norm
    fcntl.flock(other, fcntl.LOCK_EX)
    assert systematic.w2_norm2(blocks[1], scales[1], wait=False) is None
    done = {}
    thread = threading.Thread(target=lambda: done.update(systematic.fill_w2_norms2(weights, [0, 1, 2])))
    thread.start()
    thread.join(2.0)
    assert thread.is_alive() and not done  # waiting for expert 1
    written = {p.name for p in path.rglob("*") if p.is_file() and p.suffix != ".lock"}
    assert written == {systematic._digest(blocks[e], scales[e]) for e in (0, 2)}  # computed meanwhile
    (path / key[:2] / key).write_text(repr(123.0))  # the other worker's result
    fcntl.flock(other, fcntl.LOCK_UN)
    other.close()
    thread.join(60)
    assert done[1] == 123.0 and done[0] == systematic.w2_norm2(blocks[0], scales[0]) != 123.0
    systematic._NORMS.clear()


def test_a_case_is_one_workers_and_the_heaviest_start_first(tmp_path, monkeypatch):
    """``by_case`` groups a sweep's pairs by case (with several workers the heaviest layer first,
    its cases together and heaviest first), and a check in two workers runs every backend of a
    case in the same worker, both workers busy."""
    import subprocess
    import sys

    from mxmoe.harness.run.sweep import by_case, case_cost

    cases = [c for c in profile_cases("pr") if c.id in CASES]
    pairs = [c for c in cases for _ in range(3)]
    groups = by_case(list(range(len(pairs))), pairs)
    assert [[pairs[i].id for i in g] for g in groups] == [[c.id] * 3 for c in cases]
    heavy = by_case(list(range(len(pairs))), pairs, heaviest_first=True)
    assert sorted(map(sorted, heavy)) == sorted(map(sorted, groups))
    layers = [pairs[g[0]].conversion_key for g in heavy]
    runs = [k for n, k in enumerate(layers) if n == 0 or k != layers[n - 1]]
    assert len(runs) == len(set(layers)) >= 2  # each layer's cases one after the other
    totals = [sum(case_cost(c) for c in cases if c.conversion_key == k) for k in runs]
    assert totals == sorted(totals, reverse=True)
    for k in runs:
        costs = [case_cost(pairs[g[0]]) for g in heavy if pairs[g[0]].conversion_key == k]
        assert costs == sorted(costs, reverse=True)
    log = tmp_path / "where.txt"
    where = HERE.parent / "faulty_backends.py"
    args = ["check", "--profile", "pr", "-k", "tiny-interleaved", "--backend-file", f"{where}:WhereRan",
            "--backend-file", f"{where}:WhereRanB", "--backend", "where-ran-*", "--workers", "2",
            "--results", str(tmp_path / "r")]  # fmt: skip
    env = {**__import__("os").environ, "MXMOE_TEST_WHERE_RAN": str(log)}
    proc = subprocess.run([sys.executable, "-m", "harness", *args], cwd=HERE.parents[2], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ran = [line.split() for line in log.read_text().splitlines()]
    by = {}
    for _backend, case, pid in ran:
        by.setdefault(case, set()).add(pid)
    assert len(by) >= 4 and {b for b, _, _ in ran} == {"where-ran-a", "where-ran-b"}
    assert all(len(pids) == 1 for pids in by.values()), by
    assert len({pid for _, _, pid in ran}) == 2


@pytest.mark.parametrize("spec", ["mxmoe.harness.instruments.honest:HonestFp32"])
def test_a_new_case_draws_new_inputs(spec):
    item = load_spec(spec)
    a, b = [c for c in profile_cases("pr") if c.id in CASES[:2]]
    _SHARED.clear()
    _, first = check_pair(item, a, ARCH)
    _, again = check_pair(item, a, ARCH)
    _, other = check_pair(item, b, ARCH)
    assert again is first and other is not first and other.case.id == b.id


def test_a_recorded_sweep_is_what_each_test_alone_gives(tmp_path):
    """``check`` in two workers (each sharing its cases among the backends it runs), recorded; each
    record against the same test checked alone in this process, on as many threads as each worker
    had (a float sum's order follows the BLAS threads: the energy threshold's eigenvalue moves in
    its 8th digit between 1 and 2 threads, which is not what this test is about)."""
    import os
    import subprocess
    import sys

    import torch

    from mxmoe.harness.run.results import Recorder, read_results

    root = HERE.parents[2]
    args = ["check", "--profile", "pr", "-k", "small-interleaved-t16", "--backend", "emulation",
            "--backend", "honest-*", "--backend-file", f"{ENGINE}:WritesX", "--backend", "writes-x", "--workers", "2",
            "--results", str(tmp_path / "swept")]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "harness", *args], cwd=root, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    swept = read_results(tmp_path / "swept")
    assert "writes-x" in {r["backend"] for r in swept} and len({r["backend"] for r in swept}) >= 6
    assert len({r["case_id"] for r in swept}) >= 4
    alone = Recorder(tmp_path / "alone")
    loaded = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))  # a worker's (``Sweep.run``)
    try:
        for rec in swept:  # each test again, alone, recorded the same way
            item = loaded.setdefault(rec["backend_spec"], load_spec(rec["backend_spec"]))
            case = next(c for c in profile_cases("pr") if c.id == rec["case_id"])
            alone.record(run_case(item.backend, case, ARCH)[0], item)
    finally:
        torch.set_num_threads(threads)
    again = {r["test_id"]: r for r in read_results(tmp_path / "alone")}
    assert len(again) == len(swept)
    for rec in swept:
        other = again[rec["test_id"]]
        for key in ("outcome", "reason", "findings", "metrics"):
            assert rec[key] == other[key], (rec["test_id"], key)


@pytest.mark.parametrize(("workers", "times"), [(1, 1), (2, 1), (2, 2)])
def test_a_test_out_of_memory_beside_other_workers_runs_again(tmp_path, workers, times):
    """Beside other workers an out-of-memory ERROR says nothing of the backend: the sweep puts the
    test back in the queue (its case admitted with more memory), and the second time runs it again
    at the end, one worker alone; each time the log names it. Alone (one worker) it is the ERROR it
    is."""
    import json
    import os
    import subprocess
    import sys

    where = HERE.parent / "faulty_backends.py"
    oom = tmp_path / "oom"
    oom.mkdir()
    args = ["check", "--profile", "pr", "-k", "tiny-interleaved", "--backend-file", f"{where}:OutOfMemoryOnce",
            "--backend", "oom-once", "--workers", str(workers), "--results", str(tmp_path / "r")]  # fmt: skip
    env = {**os.environ, "MXMOE_TEST_OOM_DIR": str(oom), "MXMOE_TEST_OOM_TIMES": str(times)}
    proc = subprocess.run([sys.executable, "-m", "harness", *args], cwd=HERE.parents[2], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    rows = [json.loads(line) for f in (tmp_path / "r").glob("*.jsonl") for line in f.read_text().splitlines()]
    ran = [line.split()[0] for line in (oom / "ran.txt").read_text().splitlines()]
    cases = sorted({r["case_id"] for r in rows})
    assert len(cases) >= 2 and len(rows) == len(cases), rows
    if workers == 1:
        assert proc.returncode != 0 and {r["outcome"] for r in rows} == {"ERROR"}
        assert all("OutOfMemoryError" in r["traceback"] for r in rows)
        assert sorted(ran) == cases
        assert "ran out of GPU memory beside" not in proc.stderr
        return
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert {r["outcome"] for r in rows} == {"PASS"}
    # out of memory `times` times beside the other worker, then the check's two runs
    assert sorted(ran) == sorted(cases * (times + 2))
    named = [line for line in proc.stderr.splitlines() if line.startswith("check: oom-once-")]
    assert len(named) == len(cases) * times, proc.stderr
    assert sum(line.endswith("; back in the queue, its case whole") for line in named) == len(cases)
    assert sum(line.endswith("; set aside to run again alone at the end") for line in named) == len(cases) * (times - 1)
    alone = f"check: {len(cases)} test(s) ran out of GPU memory beside other workers twice; running them again"
    assert (alone in proc.stderr) == (times == 2), proc.stderr
    last = [line for line in proc.stderr.splitlines() if " done (" in line][-1]
    told = f"; out of memory beside others {len(cases) * times} times"
    told += f" ({len(cases)} tests set aside to run alone at the end)" if times == 2 else ""
    assert last.endswith(f"{told}) in " + last.rsplit(" in ", 1)[1]), last
    # the attempts' reproducers are not left beside a verdict that has none
    assert not list((tmp_path / "r").rglob("repro/*")), list((tmp_path / "r").rglob("repro/*"))


def test_on_several_gpus_the_tests_out_of_memory_run_again_on_each_gpu_alone(tmp_path, monkeypatch):
    """With 4 workers on 2 GPUs, the reruns at the end keep one worker per GPU (workers 0 and 1,
    pinned to GPUs 0 and 1), each alone on its own, instead of one worker for the whole host. The
    workers' processes are a CPU's here; the GPUs are the sweep's pinning, stood in."""
    import os

    from mxmoe.harness.run import sweep
    from mxmoe.harness.run.results import Recorder

    oom = tmp_path / "oom"
    oom.mkdir()
    monkeypatch.setenv("MXMOE_TEST_OOM_DIR", str(oom))
    monkeypatch.setenv("MXMOE_TEST_OOM_TIMES", "2")
    once = load_spec(f"{FAULTY}:OutOfMemoryOnce")
    # cases with tokens: one without any never calls the kernel, so never runs out of memory
    cases = [c for c in profile_cases("pr") if c.id.startswith("tiny-interleaved") and c.tokens][:4]
    run = sweep.Sweep(Recorder(tmp_path / "r"), workers=4, gpus=2)
    verdicts = run.run([(once, c) for c in cases], ARCH)
    assert sorted(v.result.outcome for v in verdicts) == ["PASS"] * len(cases), [v.result.reason for v in verdicts]
    ran = [line.split() for line in (oom / "ran.txt").read_text().splitlines()]
    # out of memory twice beside the others (back in the queue, then set aside), then the check's two runs
    first, again = ran[: 2 * len(cases)], ran[2 * len(cases) :]
    assert sorted(c for c, _ in first) == sorted(c.id for c in cases * 2)
    assert sorted(c for c, _ in again) == sorted(c.id for c in cases * 2)
    assert len({pid for _, pid in first}) > 1 and len({pid for _, pid in again}) == 2, ran
    assert os.environ["MXMOE_TEST_OOM_DIR"] == str(oom)


def test_a_per_layer_conversion_is_kept_across_the_layers_cases_and_changes_no_verdict(monkeypatch):
    """A backend that ``converts_per_layer`` converts once for a layer's cases in a worker (here on
    a CPU, its bytes measured by a stand-in meter), each verdict and number that of the case checked
    alone; another layer converts again and replaces what was kept (a worker holds no layer it has
    left), and a full budget keeps nothing new."""
    from mxmoe.harness.contract.cases import make_case
    from mxmoe.harness.run import sweep

    faulty = load_spec(f"{FAULTY}:ConvertsPerLayer")
    cls = type(faulty.backend)
    kept = sweep._Converted(budget=1 << 30, meter=lambda device: 0)
    monkeypatch.setattr(sweep, "_CONVERTED", kept)
    layer = [make_case("tiny", t) for t in (1, 8, 33)] + [make_case("tiny", 16, skew="hot")]
    other = [make_case("tiny", 8, routing="RenormalizeNaive"), make_case("tiny", 8, inputs="trained")]
    assert len({c.conversion_key for c in layer}) == 1 and len({c.conversion_key for c in layer + other}) == 3
    _SHARED.clear()
    cls.conversions = 0
    for case in layer + other:
        result, _ = check_pair(faulty, case, ARCH)
        alone, _ = run_case(faulty.backend, case, ARCH)
        assert result.outcome == alone.outcome == "PASS", result.reason
        assert vars(result.metrics) == vars(alone.metrics)
    assert cls.conversions == 3 + len(layer + other)  # 3 layers in the sweep, and every check alone
    assert [key[1] for key in kept.kept] == [other[-1].conversion_key]  # the last layer's only
    ticks = iter(range(1 << 20))
    full = sweep._Converted(budget=0, meter=lambda device: next(ticks))  # each conversion 1 byte: none fits
    monkeypatch.setattr(sweep, "_CONVERTED", full)
    cls.conversions = 0
    for case in layer:
        check_pair(faulty, case, ARCH)
    assert cls.conversions == len(layer) and not full.kept


def test_a_kept_conversion_of_a_backend_that_writes_into_its_inputs_is_dropped(monkeypatch):
    """The case that converts catches the write (the inputs are compared bit for bit), and the
    backend converts again at the next case instead of running on what it kept."""
    from mxmoe.harness.contract.cases import make_case
    from mxmoe.harness.run import sweep

    writes = load_spec(f"{FAULTY}:WritesWeightsPerLayer")
    cls = type(writes.backend)
    kept = sweep._Converted(budget=1 << 30, meter=lambda device: 0)
    monkeypatch.setattr(sweep, "_CONVERTED", kept)
    _SHARED.clear()
    cls.conversions = 0
    for t in (1, 8):
        result, _ = check_pair(writes, make_case("tiny", t), ARCH)
        assert result.outcome == "FAIL" and result.inputs_modified == ["w2_scales"], result.reason
        assert not kept.kept
    assert cls.conversions == 2


def test_a_case_is_admitted_with_what_tests_on_its_weights_took_where_that_is_more():
    """``case_gpu_gib`` is an estimate from the weights; once a test on weights of the same size
    records a larger peak (``device_peak_gib``), later cases of that size are admitted with
    ``PEAK_MARGIN`` times it, and a smaller peak or another size changes nothing."""
    from mxmoe.harness.contract import platforms
    from mxmoe.harness.contract.cases import Case, make_case
    from mxmoe.harness.judge.engine import Result
    from mxmoe.harness.run import sweep

    needs = sweep._Needs()
    big, other, small = make_case("gptoss20b", 4096), make_case("gptoss20b", 1), make_case("tiny", 8)
    estimate = platforms.case_gpu_gib(big)
    assert needs(big) == needs(other) == estimate and needs(small) == 1.0

    def seen(case: Case, peak: float | None, outcome: str = "PASS") -> None:
        result = Result(f"x-{case.id}", "x", ARCH, case, outcome)
        result.device_peak_gib = peak
        needs.saw(result)

    seen(big, estimate / 2)
    seen(small, None)  # a CPU records none
    assert needs(big) == estimate and needs(small) == 1.0
    seen(big, 20.0, "ERROR")  # ran out of memory after taking 20 GiB: it needs at least that
    assert needs(other) == needs(big) == pytest.approx(platforms.PEAK_MARGIN * 20.0) and needs(big) > estimate
    assert needs(small) == 1.0 and needs(make_case("gptoss120b", 1)) == platforms.WORKER_GPU_GIB
    # beside other cases it ran out of memory under 25 GiB, its message silent on how much it took:
    # its size's cases are admitted with twice that
    doubled = 2 * platforms.PEAK_MARGIN * 20.0
    assert needs.out_of_memory(big, None) == pytest.approx(doubled) == needs(other)
    seen(big, 30.0)  # a smaller peak later changes nothing
    assert needs.out_of_memory(big, 30.0) == pytest.approx(doubled)  # inside its admission: a neighbour's fault
    assert needs.out_of_memory(big, 60.0) == pytest.approx(platforms.PEAK_MARGIN * 60.0) == needs(other)
    assert needs(small) == 1.0 and needs(make_case("gptoss120b", 1)) == platforms.WORKER_GPU_GIB


def test_a_long_prefill_case_is_admitted_with_its_tokens_and_a_decode_case_without_them():
    """Past ``UNIT_TOKENS`` a case's tokens count (``tokens_gpu_gib``): gpt-oss-20b at T=16384 is
    admitted with more than twice its weights' 15 GiB, while every case of the unit's tokens or
    fewer keeps its weights' estimate, and a layer's converted weights stay budgeted by the layer.
    What a long prefill test took is learned less its tokens: it raises the layer's decode cases by
    what their weights showed, not by the prefill's activations, and a decode test's peak admits
    the prefill case with its own tokens on top."""
    from mxmoe.harness.contract import platforms
    from mxmoe.harness.contract.cases import make_case
    from mxmoe.harness.judge.engine import Result
    from mxmoe.harness.run import sweep

    decode, edge, prefill = (make_case("gptoss20b", t) for t in (4, platforms.UNIT_TOKENS, 16384))
    weights = platforms.weights_gpu_gib(decode)
    assert weights == pytest.approx(platforms.WORKER_GPU_GIB / 4)  # 32 of gpt-oss-120b's 128 experts
    assert platforms.tokens_gpu_gib(decode) == platforms.tokens_gpu_gib(edge) == 0.0
    assert platforms.case_gpu_gib(decode) == platforms.case_gpu_gib(edge) == weights
    routed = (16384 - platforms.UNIT_TOKENS) * 4 * platforms.ROUTED_TOKEN_BYTES / (1 << 30)
    assert platforms.tokens_gpu_gib(prefill) == pytest.approx(routed) and routed > weights
    assert platforms.case_gpu_gib(prefill) == pytest.approx(weights + routed)
    assert platforms.converted_gpu_gib(prefill) == platforms.converted_gpu_gib(decode) == pytest.approx(3.0)
    # a small layer's rows are small: its long case adds a fraction of a GiB to its 1 GiB floor
    assert 0.0 < platforms.tokens_gpu_gib(make_case("odd", 8192)) < 0.25

    def seen(needs: sweep._Needs, case, peak: float) -> None:
        result = Result(f"x-{case.id}", "x", ARCH, case, "PASS")
        result.device_peak_gib = peak
        needs.saw(result)

    needs = sweep._Needs()
    seen(needs, prefill, routed + 20.0)  # its weights' part: 20 GiB
    assert needs(decode) == pytest.approx(platforms.PEAK_MARGIN * 20.0)
    assert needs(prefill) == pytest.approx(platforms.PEAK_MARGIN * (20.0 + routed))
    needs = sweep._Needs()
    seen(needs, decode, 24.0)
    assert needs(prefill) == pytest.approx(platforms.PEAK_MARGIN * (24.0 + routed))
    # out of memory beside others: what it took, less its tokens, raises the layer
    assert needs.out_of_memory(prefill, routed + 40.0) == pytest.approx(platforms.PEAK_MARGIN * (40.0 + routed))
    assert needs(decode) == pytest.approx(platforms.PEAK_MARGIN * 40.0)


def test_what_a_test_out_of_memory_took_is_read_from_torchs_message():
    """torch's CUDA message says what the process had in use and what it asked for; their sum is
    what the test took. A message that does not say gives None (the sweep then doubles)."""
    from mxmoe.harness.contract.cases import make_case
    from mxmoe.harness.judge.engine import Result
    from mxmoe.harness.run import sweep

    case = make_case("gptoss20b", 4096)
    torch_says = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total "
                  "capacity of 139.81 GiB of which 1.02 GiB is free. Process 1234 has 60.00 GiB memory in use. "
                  "Including non-PyTorch memory, this process has 28.25 GiB memory in use. Of the allocated memory "
                  "26.1 GiB is allocated by PyTorch, and 1.2 GiB is reserved by PyTorch but unallocated.")  # fmt: skip
    result = Result("x", "x", ARCH, case, "ERROR", reason="torch.OutOfMemoryError", traceback=torch_says)
    assert sweep.out_of_memory(result) and sweep.took_gib(result) == pytest.approx(29.75)
    result.traceback = torch_says.replace("1.50 GiB", "512.00 MiB")
    assert sweep.took_gib(result) == pytest.approx(28.75)
    result.traceback = "CUDA out of memory. Tried to allocate 7.91 GiB (a test's stand-in)"
    assert sweep.out_of_memory(result) and sweep.took_gib(result) is None


def test_a_case_out_of_memory_beside_others_runs_again_whole_with_twice_the_memory(tmp_path, monkeypatch):
    """The first test of a case runs out of memory beside another worker's case: its worker leaves
    the case (the rest would each run out in turn), and the whole case goes back in the queue
    admitted with twice its memory, here more than the GPU's share, so that it runs again with no
    other case beside it. The admission is the parent's, so a CPU shows it with the memory needs
    and the failed allocation stood in."""
    import os

    from mxmoe.harness.run import sweep
    from mxmoe.harness.run.results import Recorder

    log, oom = tmp_path / "when.txt", tmp_path / "oom"
    oom.mkdir()
    monkeypatch.setenv("MXMOE_TEST_WHERE_RAN", str(log))
    monkeypatch.setenv("MXMOE_TEST_OOM_DIR", str(oom))
    occupies, once = load_spec(f"{FAULTY}:Occupies"), load_spec(f"{FAULTY}:OutOfMemoryOnce")
    cases = [c for c in profile_cases("pr") if c.id.startswith("tiny-interleaved") and c.tokens][:6]
    big = cases[0]
    monkeypatch.setattr(sweep, "case_gpu_gib", lambda c: 3.0 if c.id == big.id else 1.0)
    told: list[tuple[str, bool]] = []
    run = sweep.Sweep(Recorder(tmp_path / "r"), workers=2, gpu_gib=4.0, gpus=1,
                      on_memory=lambda text, alone: told.append((text, alone)))  # fmt: skip
    pairs = [(occupies, c) for c in cases[1:]] + [(once, big), (occupies, big)]
    verdicts = run.run(pairs, ARCH)
    assert sorted(v.result.outcome for v in verdicts) == ["PASS"] * len(pairs), [v.result.reason for v in verdicts]
    assert len(told) == 1 and not told[0][1], told
    assert told[0][0].startswith(f"check: oom-once-{ARCH}-{big.id} ran out of GPU memory beside ")
    assert "its case with 3.0" in told[0][0] and "its size's cases now with 6.0" in told[0][0], told
    assert told[0][0].endswith("; back in the queue, its case whole")
    spans = _spans(log)
    assert not any(spans[big.id][0] < spans[c.id][1] and spans[c.id][0] < spans[big.id][1] for c in cases[1:]), spans
    ran = (oom / "ran.txt").read_text().split()[::2]
    assert ran == [big.id] * 3  # out of memory once, then the check's two runs
    assert os.environ["MXMOE_TEST_WHERE_RAN"] == str(log)


def test_an_idle_worker_frees_its_last_case_when_told(tmp_path, monkeypatch):
    """Between cases (held back for memory, or at the end) a worker holds its last case's inputs,
    oracle and conversions, which no admission counts: told ``RELEASE``, it lets them go."""
    import threading
    import time
    import weakref
    from multiprocessing import Pipe

    import torch

    from mxmoe.harness.run import sweep

    kept = sweep._Converted(budget=1 << 30, meter=lambda device: 0)
    monkeypatch.setattr(sweep, "_CONVERTED", kept)
    case = next(c for c in profile_cases("pr") if c.id.startswith("tiny-interleaved") and c.tokens)
    parent, child = Pipe()
    worker = threading.Thread(target=sweep.worker_main, args=(child, str(tmp_path), torch.get_num_threads()))
    worker.start()
    try:
        parent.send((0, f"{FAULTY}:ConvertsPerLayer", case.to_dict(), ARCH, 0))
        assert parent.recv() == ("begin", 0)
        assert parent.recv()[2].outcome == "PASS"
        assert sweep._SHARED.key is not None and kept.kept
        # the worker's own reference to the last inputs goes too, not only the shared one
        drawn = weakref.ref(sweep._SHARED.inputs.x)
        parent.send(sweep.RELEASE)
        waited = time.monotonic()
        while (sweep._SHARED.key is not None or kept.kept) and time.monotonic() - waited < 60:
            time.sleep(0.01)
        time.sleep(0.2)  # the release is done once the worker waits for its next task
        idle_holds = worker.is_alive() and drawn() is not None
        parent.send(None)
    finally:
        worker.join(60)
    assert not worker.is_alive()
    assert sweep._SHARED.key is None and not kept.kept
    assert not idle_holds  # idle, it held nothing of the case


def test_a_worker_gives_its_allocators_cache_back_after_each_test_that_left_more_than_the_slack(tmp_path, monkeypatch):
    """A process holds what its allocator reserved, not only what it allocated, and admission counts
    allocated peaks: past ``CACHE_KEPT_GIB`` of cached, unallocated memory, ``return_cached``
    empties the cache, and a worker calls it after every test, not only at a case switch. The
    GPU's counters are stood in here, so this runs on any host."""
    import threading
    from multiprocessing import Pipe

    import torch

    from mxmoe.harness.contract import platforms
    from mxmoe.harness.run import sweep

    emptied, reserved = [], [platforms.CACHE_KEPT_GIB]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *_: 10 << 30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *_: int((10 + reserved[0]) * (1 << 30)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(reserved[0]))
    assert not platforms.return_cached() and not emptied  # at the slack: the cache stays
    reserved[0] += 0.5
    assert platforms.return_cached() and emptied == [reserved[0]]
    monkeypatch.undo()

    calls = []
    monkeypatch.setattr(sweep, "return_cached", lambda: calls.append(1) or False)
    case = next(c for c in profile_cases("pr") if c.id == "tiny-interleaved-default-t8")
    parent, child = Pipe()
    worker = threading.Thread(target=sweep.worker_main, args=(child, str(tmp_path), torch.get_num_threads()))
    worker.start()
    try:
        for n, spec in enumerate(("mxmoe.kernels.emulation:Emulation", "mxmoe.harness.instruments.honest:HonestFp32")):
            parent.send((n, spec, case.to_dict(), ARCH, 0))
            assert parent.recv() == ("begin", n)
            assert parent.recv()[2].outcome == "PASS"
            assert len(calls) == n + 1  # after each test of the case, not at its switch alone
    finally:
        parent.send(None)
        worker.join(60)
    assert not worker.is_alive()


def test_cases_run_on_a_gpu_together_only_while_their_memory_fits(tmp_path, monkeypatch):
    """A sweep admits a case onto a worker's GPU only while the cases running there fit the GPU's
    share (``Sweep.gpu_gib``, each case's ``platforms.case_gpu_gib``): two large cases never run
    at once, a small one runs beside a large one, and one larger than the whole share runs alone.
    The admission is the parent's, so a CPU shows it with the memory needs stood in."""
    import os

    from mxmoe.harness.run import sweep
    from mxmoe.harness.run.results import Recorder

    log = tmp_path / "when.txt"
    monkeypatch.setenv("MXMOE_TEST_WHERE_RAN", str(log))
    occupies = load_spec(f"{FAULTY}:Occupies")
    cases = [c for c in profile_cases("pr") if c.id.startswith("tiny-interleaved")][:6]
    big, huge = {cases[0].id, cases[1].id}, cases[2].id
    monkeypatch.setattr(sweep, "case_gpu_gib", lambda c: 10.0 if c.id == huge else 3.0 if c.id in big else 1.0)
    # a large case waits for a small one to start elsewhere, and a small one for a large one: admitted
    # beside each other, the two overlap (a worker that starts up late no longer decides it); refused,
    # each ends after 60 s alone
    small = [c.id for c in cases[3:]]
    monkeypatch.setenv("MXMOE_TEST_AWAIT_COMPANY", f"{','.join(sorted(big))};{','.join(small)}")
    run = sweep.Sweep(Recorder(tmp_path / "r"), workers=3, gpu_gib=4.0, gpus=1)
    verdicts = run.run([(occupies, c) for c in cases], ARCH)
    assert sorted(v.result.outcome for v in verdicts) == ["PASS"] * len(cases), [v.result.reason for v in verdicts]
    spans = _spans(log)

    def overlap(a: str, b: str) -> bool:
        return spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]

    ids = [c.id for c in cases]
    assert not overlap(*big)
    assert not any(overlap(huge, other) for other in ids if other != huge)
    assert any(overlap(b, s) for b in big for s in small), spans
    assert run.times["tests"] > 0 and run.times["wall"] > 0 and "held back" in run.time_line()
    log.write_text("")  # one case at a time: the other two workers are held back while cases wait
    monkeypatch.delenv("MXMOE_TEST_AWAIT_COMPANY")
    monkeypatch.setattr(sweep, "case_gpu_gib", lambda c: 1.0)
    alone = sweep.Sweep(Recorder(tmp_path / "alone"), workers=3, gpu_gib=1.0, gpus=1)
    alone.run([(occupies, c) for c in cases[:3]], ARCH)
    spans = _spans(log)
    assert not any(overlap(a, b) for a in ids[:3] for b in ids[:3] if a < b)
    assert alone.times["held back"] > 0.4, alone.time_line()  # a second worker waited for at least one case
    assert os.environ["MXMOE_TEST_WHERE_RAN"] == str(log)


def test_a_case_overtakes_the_queues_head_only_while_the_head_could_not_run_anyway():
    """``admission``: the queue's head runs when it fits; a later case that fits goes past it only
    while what ran before the head began to wait still keeps it out, so that cases taken in its
    place cannot keep it waiting for as long as they are queued."""
    from mxmoe.harness.run.sweep import admission

    assert admission([3.0, 1.0], room=3.0, share=4.0, before_head=1.0) == 0  # it fits
    # kept out by a case that ran before it waited: the first that fits goes past it
    assert admission([3.0, 2.0, 1.0], room=1.0, share=4.0, before_head=2.0) == 2
    # kept out only by cases that went past it: no more do, and it runs when they end
    assert admission([3.0, 1.0], room=2.0, share=4.0, before_head=1.0) is None
    assert admission([3.0, 1.0], room=2.0, share=4.0, before_head=0.0) is None
    # larger than the share: gone past while a case from before it waited runs, then its GPU drains
    assert admission([9.0, 1.0], room=3.0, share=4.0, before_head=0.5) == 1
    assert admission([9.0, 1.0], room=3.0, share=4.0, before_head=0.0) is None
    assert admission([3.0, 2.0], room=1.0, share=4.0, before_head=2.0) is None  # nothing fits
    assert admission([], room=4.0, share=4.0, before_head=0.0) is None


def test_a_large_case_at_the_queues_head_is_not_kept_waiting_by_small_ones_taken_in_its_place(tmp_path, monkeypatch):
    """The sweep's admission end to end: a large case queued behind one that keeps it out starts as
    soon as that one and the small cases that went past it meanwhile have ended, not after every
    small case queued behind it has started (on an H100 a gpt-oss-120b case so waited about 95 s
    while gpt-oss-20b cases were taken). The admission is the parent's, so a CPU shows it with the
    memory needs stood in."""
    from mxmoe.harness.run import sweep
    from mxmoe.harness.run.results import Recorder

    log = tmp_path / "when.txt"
    monkeypatch.setenv("MXMOE_TEST_WHERE_RAN", str(log))
    occupies = load_spec(f"{FAULTY}:Occupies")
    cases = [c for c in profile_cases("pr") if c.id.startswith("tiny")]
    order = [cases[g[0]].id for g in sweep.by_case(list(range(len(cases))), cases, heaviest_first=True)]
    first, large, small = order[0], order[1], order[2:]
    assert len(small) >= 6, order
    gib = {first: 2.0, large: 3.0}
    monkeypatch.setattr(sweep, "case_gpu_gib", lambda c: gib.get(c.id, 1.0))
    # the first case runs beside small ones (each waits for the other to start), so that the large
    # one is kept out, at first, by a case that ran before it waited
    monkeypatch.setenv("MXMOE_TEST_AWAIT_COMPANY", f"{first};{','.join(small)}")
    run = sweep.Sweep(Recorder(tmp_path / "r"), workers=3, gpu_gib=4.0, gpus=1)
    verdicts = run.run([(occupies, c) for c in cases], ARCH)
    assert sorted(v.result.outcome for v in verdicts) == ["PASS"] * len(cases), [v.result.reason for v in verdicts]
    spans = _spans(log)
    assert any(spans[s][0] < spans[first][1] for s in small), spans  # small ones went past it meanwhile
    later = [s for s in small if spans[s][0] > spans[large][0]]
    assert later, spans  # it started before the small ones queued behind it had all started


def test_a_worker_held_back_for_memory_loads_the_queued_backends_meanwhile(tmp_path, monkeypatch):
    """A worker held back for memory loads the queued cases' backends while it waits (in an H100
    sign-off, 7 worker processes booted vLLM, 20 s each, inside their tests), so that its first test
    does not. A backend whose load raises there is loaded again inside its test by a fresh worker:
    every test says why it cannot run (a SKIP), none is an ERROR of a worker that ended before its
    test began. The admission is the parent's, so a CPU shows it with the memory needs stood in."""
    from mxmoe.harness.run import sweep
    from mxmoe.harness.run.results import Recorder

    monkeypatch.setenv("MXMOE_TEST_WHERE_RAN", str(tmp_path / "when.txt"))
    loads = tmp_path / "loads.txt"
    monkeypatch.setenv("MXMOE_TEST_LOADS", str(loads))
    cases = [c for c in profile_cases("pr") if c.id.startswith("tiny-interleaved")][:3]
    # the first case queued fills the GPU's share: the second worker is held back until it ends
    first = cases[sweep.by_case([0, 1, 2], cases, heaviest_first=True)[0][0]].id
    monkeypatch.setattr(sweep, "case_gpu_gib", lambda c: 2.0 if c.id == first else 1.0)
    slow = load_spec(f"{FAULTY}:LoadsSlowly")
    run = sweep.Sweep(Recorder(tmp_path / "slow"), workers=2, gpu_gib=2.0, gpus=1)
    verdicts = run.run([(slow, c) for c in cases], ARCH)
    assert [v.result.outcome for v in verdicts] == ["PASS"] * 3, [v.result.reason for v in verdicts]
    loading = sorted(v.result.stages.get("load", 0.0) for v in verdicts)
    assert loading[-1] >= 1.5 and loading[1] < 0.5, loading  # only the first worker's first test loaded
    assert len(loads.read_text().splitlines()) == 2, loads.read_text()  # each worker loaded once

    loads.write_text("")
    refuses = load_spec(f"{FAULTY}:RefusesToLoad")
    run = sweep.Sweep(Recorder(tmp_path / "refused"), workers=2, gpu_gib=2.0, gpus=1)
    verdicts = run.run([(refuses, c) for c in cases], ARCH)
    assert [v.result.outcome for v in verdicts] == ["SKIP"] * 3, [v.result.reason for v in verdicts]
    assert all("refuses to load: its package is missing here" in v.result.reason for v in verdicts)
    assert len(loads.read_text().splitlines()) >= 4, loads.read_text()  # the preload's, then each test's


def test_a_case_that_fits_nowhere_runs_with_no_other_worker_alive_on_its_gpu(tmp_path, monkeypatch):
    """A case larger than the GPU's share runs with no other case beside it, and also with no other
    worker's process alive on its GPU: an idle worker still holds memory no admission counts (on an
    H200, after a quarter of an hour of tactics, enough that DeepSeek-V3 ran out of memory "beside 0 other
    cases"). Nor does a worker held back for the cases queued behind it start or preload meanwhile.
    Each run notes how many other workers were alive (Linux's /proc); the small cases show that the
    count sees them."""
    import os

    from mxmoe.harness.run import sweep
    from mxmoe.harness.run.results import Recorder

    if not Path("/proc/self/stat").exists():
        pytest.skip("counts the other workers through Linux's /proc, which this host lacks")
    siblings = tmp_path / "siblings.txt"
    monkeypatch.setenv("MXMOE_TEST_WHERE_RAN", str(tmp_path / "when.txt"))
    monkeypatch.setenv("MXMOE_TEST_SIBLINGS", str(siblings))
    counts = load_spec(f"{FAULTY}:CountsSiblings")
    cases = [c for c in profile_cases("pr") if c.id.startswith("tiny-interleaved") and c.tokens][:6]
    # first in the queue, so that the small cases wait behind it while it runs: a worker held back
    # for them meanwhile is neither started nor preloaded (``alone_on``)
    order = [cases[g[0]].id for g in sweep.by_case(list(range(len(cases))), cases, heaviest_first=True)]
    huge = order[0]
    monkeypatch.setattr(sweep, "case_gpu_gib", lambda c: 10.0 if c.id == huge else 1.0)
    run = sweep.Sweep(Recorder(tmp_path / "r"), workers=3, gpu_gib=4.0, gpus=1)
    verdicts = run.run([(counts, c) for c in cases], ARCH)
    assert sorted(v.result.outcome for v in verdicts) == ["PASS"] * len(cases), [v.result.reason for v in verdicts]
    seen = [(case, int(n)) for _, case, n in (line.split() for line in siblings.read_text().splitlines())]
    assert {n for case, n in seen if case == huge} == {0}, seen
    assert max(n for case, n in seen if case != huge) >= 1, seen  # beside the small ones, others lived
    assert os.environ["MXMOE_TEST_SIBLINGS"] == str(siblings)


def test_a_tests_device_peak_is_split_into_what_was_held_and_what_each_stage_raised(monkeypatch):
    """On a GPU a test's record says what its peak is made of: what was allocated when it began,
    what each stage raised the peak by (a stage that stays under the peak so far raises nothing),
    and the rest; the sweep's memory line names the largest model's worst test and its parts.
    The GPU's counter is replaced here by a script of peaks, so this runs on any host."""
    from mxmoe.harness.contract.cases import make_case
    from mxmoe.harness.judge import engine
    from mxmoe.harness.judge.engine import Result, StageClock
    from mxmoe.harness.run import sweep

    gib = 1 << 30
    peaks = iter([10 * gib, 14 * gib, 14 * gib, 14 * gib, 14 * gib, 20 * gib])  # read at each stage's ends
    monkeypatch.setattr(engine, "_device_peak", lambda: next(peaks))
    clock = StageClock()
    for name in ("oracle and bound", "convert", "systematic"):
        with clock.stage(name):
            pass
    assert clock.raised["oracle and bound"] == 4.0 and clock.raised["convert"] == 0.0
    assert clock.raised["systematic"] == 6.0
    held = {"held: conversions": 5.0, "held: case": 3.0, "held: other": 0.0}
    parts = sweep.peak_parts(clock, held, 21.5)
    assert parts == {"held: conversions": 5.0, "held: case": 3.0, "oracle and bound": 4.0, "systematic": 6.0,
                     "other": 3.5}  # fmt: skip
    with pytest.raises(ValueError, match="stage must be one of"):
        with clock.stage("oracle"):
            pass

    run = sweep.Sweep(recorder=None)
    assert run.memory_line() is None  # no test recorded a peak (a CPU)
    for model, tokens, peak, made in (("gptoss20b", 1, 19.0, {}), ("gptoss120b", 1, 21.5, parts),
                                      ("gptoss120b", 4, 30.0, {"held: other": 12.0, "convert": 18.0})):  # fmt: skip
        result = Result(f"x-{model}-{tokens}", "x", ARCH, make_case(model, tokens), "PASS")
        result.device_peak_gib, result.device_peak_parts = peak, made
        run.verdicts.append(sweep.Verdict(result, None))
    assert run.memory_line() == (
        "check: device memory of gptoss120b's 2 tests: median peak 25.8 GiB, largest 30.0 GiB "
        "(x-gptoss120b-4: convert 18.0, held: other 12.0)"
    )


@pytest.mark.parametrize("spec", ["KeepsAnError", "KeepsTheLastError"])
def test_a_worker_keeps_nothing_of_a_case_through_an_error_a_backend_kept(tmp_path, monkeypatch, spec):
    """A library that keeps an error raised inside a test keeps that traceback's frames, and each
    finished frame its caller's and its locals: without the worker clearing them, the harness's
    frames would keep the case's inputs and oracle after the worker let the case go. Two cases in a
    row: a library that keeps only its latest error drops the first test's frames and keeps the
    second's, so the references to the worker's own frame are as many after that test as before."""
    import threading
    import weakref
    from multiprocessing import Pipe

    import torch

    from mxmoe.harness.run import sweep

    monkeypatch.setattr(sweep, "_CONVERTED", sweep._Converted(budget=1 << 30, meter=lambda device: 0))
    cases = [c for c in profile_cases("pr") if c.id.startswith("tiny-interleaved") and c.tokens][:2]
    parent, child = Pipe()
    worker = threading.Thread(target=sweep.worker_main, args=(child, str(tmp_path), torch.get_num_threads()))
    worker.start()
    drawn = []
    try:
        for index, case in enumerate(cases):
            parent.send((index, f"{FAULTY}:{spec}", case.to_dict(), ARCH, 0))
            assert parent.recv() == ("begin", index)
            assert parent.recv()[2].outcome == "PASS"
            drawn.append(weakref.ref(sweep._SHARED.inputs.x))
            drawn.append(weakref.ref(next(iter(sweep._SHARED.bounds.values()))[0]))
        parent.send(sweep.RELEASE)
        parent.send(None)
    finally:
        worker.join(60)
    assert not worker.is_alive()
    files = [m for name, m in list(sys.modules.items()) if name.startswith("mxmoe_backend_file_")]
    kept = [e for m in files if hasattr(m, "KeepsAnError") for e in m.KEPT]
    assert kept and kept[-1].__traceback__ is not None  # the error is still kept, its traceback too
    assert [ref() is None for ref in drawn] == [True] * 4  # but nothing of either case through it


def test_a_worker_leaving_a_case_lets_go_of_its_inputs_and_of_other_layers_conversions(monkeypatch):
    """``leave_case``: the shared inputs and oracle go, so do the conversions of every layer but the
    next case's; the next case's layer keeps its own."""
    from mxmoe.harness.run import sweep

    honest = load_spec("mxmoe.harness.instruments.honest:HonestFp32")
    cases = {c.id: c for c in profile_cases("pr")}
    case, other = cases["tiny-interleaved-default-t8"], cases["small-interleaved-t16-trained"]
    kept = sweep._Converted()
    kept.kept[("a", case.conversion_key)] = (None, 10)
    kept.kept[("b", other.conversion_key)] = (None, 20)
    monkeypatch.setattr(sweep, "_CONVERTED", kept)
    _SHARED.clear()
    assert check_pair(honest, case, ARCH)[0].outcome == "PASS" and _SHARED.inputs is not None
    sweep.leave_case(other)
    assert _SHARED.inputs is None and _SHARED.bounds == {}
    assert list(kept.kept) == [("b", other.conversion_key)]
