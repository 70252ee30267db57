"""Sharded checks with torch.distributed (gloo on this CPU; NCCL where GPUs are): TP and EP shards
through the same backend adapters combine to the unsharded oracle, every planted sharding fault is
caught, and a rank that dies or raises is the check's ERROR."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mxmoe.harness.cli.app import main
from mxmoe.harness.contract.cases import make_case
from mxmoe.harness.distributed.launch import run_dist
from mxmoe.harness.distributed.shard import FAULTS, Plan, reduction_bound
from mxmoe.harness.run.registry import load_spec
from mxmoe.harness.run.results import read_results

SUITES = Path(__file__).resolve().parents[1]
BACKENDS = {"emulation": "mxmoe.kernels.emulation:Emulation",
            "portable-triton": "mxmoe.kernels.portable_triton:PortableTriton"}  # fmt: skip
CASE = make_case("tpsmall", 9)  # I=224: TP2 shards 128 + 96, TP4 64 x 3 + 32; EP4: the last rank owns no token


def _arch(world: int) -> str:
    """Where a check of ``world`` ranks runs: on this host's GPUs (NCCL) where it has that many, else
    on its CPU (gloo), which every host has."""
    from mxmoe.harness.contract.platforms import host_arch

    return host_arch() if torch.cuda.is_available() and torch.cuda.device_count() >= world else "cpu"


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("mode,world", [("tp", 2), ("tp", 4), ("ep", 2), ("ep", 4)])
def test_shards_combine_to_the_unsharded_oracle(backend, mode, world):
    from mxmoe.kernels.portable_triton import PortableTriton

    if backend == "portable-triton" and _arch(world) == "cpu" and (why := PortableTriton.interpreter_unsupported()):
        pytest.skip(f"{world} ranks on this host's CPU (it has fewer GPUs): {why}")
    result = run_dist(load_spec(BACKENDS[backend]), Plan(CASE, mode, world), _arch(world), timeout=300)
    assert result.outcome == "PASS", f"{result.reason}\n{result.traceback}"
    m = result.metrics
    assert 0 < m.worst_ratio < 1 and m.elements == CASE.tokens * CASE.hidden
    # the tests beyond the bound ran on the combined output, with the ranks' noise, and stayed quiet
    assert m.systematic_z is not None and m.systematic_z < m.systematic_threshold, m.systematic
    assert m.energy_ratio is not None and m.energy_ratio < m.energy_threshold, m.energy


def test_the_w2_bias_on_every_rank_is_named_by_the_bias_projection_where_within_the_bound():
    """The combined output moved along one expert's b2 by less than the bound everywhere: the
    sharded check's projections (unsharded directions, per-rank noise) name that expert's bias."""
    import dataclasses

    from mxmoe.harness.contract.inputs import make_inputs
    from mxmoe.harness.distributed.rank import combined_terms
    from mxmoe.harness.distributed.shard import tp_rank_inputs
    from mxmoe.harness.instruments.honest import HonestFp32
    from mxmoe.harness.judge.bounds import Bounded, reference_and_bound
    from mxmoe.harness.judge.systematic import _bias_directions, systematic_test

    case = make_case("tpsmall", 256, skew="hot")
    plan = Plan(case, "tp", 2)
    full = make_inputs(case)
    ar = HonestFp32.declaration.arithmetic
    exact = reference_and_bound(full, ar)
    owns = [reference_and_bound(tp_rank_inputs(full, plan, r, planted=False), ar) for r in range(2)]
    rig = sum(o.rigorous for o in owns)
    terms = combined_terms(plan, exact.terms, [o.terms for o in owns], torch.zeros_like(rig))
    assert terms.intermediate.shape == exact.terms.intermediate.shape
    assert torch.allclose(terms.intermediate, exact.terms.intermediate)  # the ranks' slices make the layer
    bounded = Bounded(exact.ref, rig, sum(o.bound for o in owns), terms)
    v = _bias_directions(full.weights, terms, exact.ref.device)["bias2"].double()
    e = int(torch.mode(exact.terms.ids[:, 0]).values)
    shift = torch.where((terms.ids == e).unsqueeze(-1), v, torch.zeros_like(v)).sum(1)
    touched = shift != 0
    got = (exact.ref + 0.25 * float((bounded.bound[touched] / shift[touched].abs()).min()) * shift).to(torch.bfloat16)
    assert float(((got.double() - exact.ref).abs() / bounded.bound).max()) < 1
    found = systematic_test(full.weights, bounded, got)
    assert found.fired and found.where.startswith(f"expert {e}'s w2 bias"), found.finding()
    assert not systematic_test(full.weights, bounded, exact.ref.to(torch.bfloat16)).fired
    assert dataclasses.replace(plan, fault="bias-every-rank").fault == "bias-every-rank"


@pytest.mark.parametrize("fault,mode,world", [("bias-every-rank", "tp", 2), ("padding-unzeroed", "tp", 4),
                                              ("token-twice", "ep", 2), ("skip-allreduce", "tp", 4),
                                              ("skip-allreduce", "ep", 4)])  # fmt: skip
def test_every_planted_sharding_fault_is_caught(fault, mode, world):
    result = run_dist(load_spec(BACKENDS["emulation"]), Plan(CASE, mode, world, fault), _arch(world), timeout=300)
    assert result.outcome == "FAIL", result.reason
    assert result.metrics.over_rigorous > 0  # beyond even the rigorous bound: wrong for certain
    if fault == "skip-allreduce" and mode == "tp":
        assert result.reason.startswith("rank 3's output")  # the rank that skipped, named
    assert set(FAULTS) == {"bias-every-rank", "padding-unzeroed", "token-twice", "skip-allreduce"}


def test_a_rank_that_dies_or_raises_is_an_error_and_the_next_check_runs():
    crash = load_spec(f"{SUITES / 'harness' / 'faulty_backends.py'}:CrashFp32")  # os._exit(3) at T=1
    died = run_dist(crash, Plan(make_case("tpsmall", 1), "tp", 2), _arch(2), timeout=120)
    assert died.outcome == "ERROR" and "a rank process died" in died.reason and "exit code 3" in died.reason
    raising = load_spec(f"{SUITES / 'reports' / 'release_backends.py'}:RaisesAt3")
    raised = run_dist(raising, Plan(make_case("tpsmall", 3), "tp", 2), _arch(2), timeout=120)
    assert raised.outcome == "ERROR" and raised.reason == "the backend raised on rank(s) 0, 1"
    assert "illegal memory access was encountered (simulated)" in raised.traceback
    after = run_dist(crash, Plan(make_case("tpsmall", 2), "tp", 2), _arch(2), timeout=120)
    assert after.outcome == "PASS"


def test_plans_that_cannot_be_sharded_say_why():
    with pytest.raises(ValueError, match=r"TP 8 leaves a rank without intermediate blocks of I=224"):
        Plan(CASE, "tp", 8)
    with pytest.raises(ValueError, match="EP 3 must divide the 8 experts"):
        Plan(CASE, "ep", 3)
    with pytest.raises(ValueError, match="fault token-twice applies to ep, not tp"):
        Plan(CASE, "tp", 2, "token-twice")
    with pytest.raises(ValueError, match="mode must be one of tp, ep"):
        Plan(CASE, "dp", 2)


def test_the_reduction_term_covers_summing_in_bf16_in_any_order():
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(64, 256, generator=gen).to(torch.bfloat16) for _ in range(8)]
    exact = sum(p.to(torch.float64) for p in parts)
    bound = reduction_bound(parts, torch.bfloat16)
    for order in (range(8), reversed(range(8)), (3, 1, 7, 0, 5, 2, 6, 4)):
        acc = torch.zeros(64, 256, dtype=torch.bfloat16)
        for i in order:
            acc = acc + parts[i]  # rounded to bf16 at every step, as a ring all-reduce does
        assert ((acc.to(torch.float64) - exact).abs() <= bound).all()


def test_the_command_records_each_check_and_fails_on_a_planted_fault(tmp_path):
    argv = ["dist-check", "--ep", "2", "--backend", "emulation", "--tokens", "4", "--results", str(tmp_path),
            "--arch", "cpu"]  # gloo on this host's CPU: every host can run it
    assert main(argv) == 0
    assert main([*argv, "--fault", "token-twice"]) == 1
    recs = {r["test_id"]: r["outcome"] for r in read_results(tmp_path)}
    assert recs == {"emulation-cpu-tpsmall-interleaved-t4-ep2": "PASS",
                    "emulation-cpu-tpsmall-interleaved-t4-ep2-fault-token-twice": "FAIL"}  # fmt: skip
