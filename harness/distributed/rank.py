"""One rank of a distributed check (``launch`` starts one process per rank).

Every rank: builds the unsharded case's inputs (a pure function of the case id, so every rank has
the same bytes without sending them), takes its shard (dispatching tokens by all-gather under EP),
runs the backend adapter on it into a poisoned buffer, and combines: TP all-reduces the partial
outputs; EP sums them by token and keeps its own tokens' rows (all-reduce, then the slice: the
reduce-scatter's result). A backend that raises on any rank makes the check an ERROR on every rank
without a collective left waiting. Rank 0 gathers the partials and every rank's final output and
judges them against the unsharded oracle under ``shard``'s combined bound; the worst rank decides.
"""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from mxmoe.harness.contract.cases import Case, tp_shard
from mxmoe.harness.contract.inputs import make_inputs
from mxmoe.harness.distributed import MULTICAST_OFF
from mxmoe.harness.distributed.shard import Plan, ep_rank_inputs, reduction_bound, tp_rank_inputs
from mxmoe.harness.judge.bounds import Bounded, SlotTerms, reference_and_bound
from mxmoe.harness.judge.engine import Result, compare, judge, poisoned, record_beyond_bound, still_poisoned
from mxmoe.harness.run.registry import load_spec


def _combine(plan: Plan, rank: int, partial: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """This rank's final output from its partial one (``rows``: the gathered tokens' indices)."""
    c = plan.case
    if plan.mode == "tp":
        total = partial.clone()
        dist.all_reduce(total)
        return partial.clone() if plan.fault == "skip-allreduce" and rank == plan.fault_rank else total
    by_token = torch.zeros((c.tokens, c.hidden), dtype=partial.dtype, device=partial.device)
    by_token.index_add_(0, torch.tensor(rows, device=partial.device), partial)
    total = by_token.clone()
    dist.all_reduce(total)
    t0, t1 = plan.token_slice(rank)
    keep = by_token if plan.fault == "skip-allreduce" and rank == plan.fault_rank else total
    return keep[t0:t1].clone()


def rank_main(rank: int, job: dict) -> None:
    """Entry point of one rank process; rank 0 writes the verdict to ``job["out"]``."""
    os.environ.update(MULTICAST_OFF)
    world = job["world"]
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    on_gpu = job["arch"] != "cpu"
    if not on_gpu:  # CPU ranks on a GPU host too: Triton kernels then run under its interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if on_gpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu"
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"file://{job['store']}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=job["timeout"]))  # fmt: skip
    try:
        _run(rank, job, device)
    finally:
        dist.destroy_process_group()


def _run(rank: int, job: dict, device: str) -> None:
    loaded = load_spec(job["backend_spec"])
    backend = loaded.backend
    d = backend.declaration
    plan = Plan(Case.from_dict(job["case"]), job["mode"], job["world"], job["fault"])
    full = make_inputs(plan.case, device)
    rows = list(range(plan.case.tokens))
    if plan.mode == "tp":
        given = tp_rank_inputs(full, plan, rank, planted=True)
    else:  # dispatch: every rank's tokens (and logits) to every rank, in rank order
        mine = plan.dispatched(rank)
        sent = [None] * plan.world
        dist.all_gather_object(sent, mine)
        rows = [t for part in sent for t in part]
        index = torch.tensor(rows, device=full.x.device, dtype=torch.int64)
        given = ep_rank_inputs(plan, rank, full.x.index_select(0, index), full.router_logits.index_select(0, index),
                               device)  # fmt: skip
    error = ""
    out = poisoned((len(rows), plan.case.hidden), d.arithmetic.precision.output, device)
    try:
        backend.load()
        backend.run(backend.convert(given), given, out)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
    except Exception:
        error = traceback.format_exc()
    errors = [None] * plan.world
    dist.all_gather_object(errors, error)
    if any(errors):
        if rank == 0:
            failed = [r for r, e in enumerate(errors) if e]
            _write(job, "ERROR", f"the backend raised on rank(s) {', '.join(map(str, failed))}", None,
                   "\n".join(f"rank {r}:\n{errors[r]}" for r in failed))  # fmt: skip
        return
    left = still_poisoned(out)
    # unwritten elements (still the poison) add zero here; rank 0 counts them as unwritten
    final = _combine(plan, rank, torch.where(left, torch.zeros_like(out), out), rows)
    gathered = [None] * plan.world
    dist.all_gather_object(gathered, (out.cpu(), left.cpu(), final.cpu()))
    if rank != 0:
        return
    _judge(job, plan, backend, full, gathered, rows)


def _judge(job: dict, plan: Plan, backend: object, full: object, gathered: list, rows: list[int]) -> None:
    d = backend.declaration
    ar = d.arithmetic
    device = full.x.device
    exact = reference_and_bound(full, ar)  # the unsharded oracle
    bounds, rigorous, partials, owns = [], [], [], []
    unwritten = torch.zeros(full.x.shape, dtype=torch.bool)
    for r, (out, left, _) in enumerate(gathered):
        if plan.mode == "tp":
            own = reference_and_bound(tp_rank_inputs(full, plan, r, planted=False), ar)
            b, part = own.bound.cpu(), out.to(torch.float64)
            unwritten |= left
        else:  # this rank's exact partial over every token, each dispatched once
            own = reference_and_bound(ep_rank_inputs(plan, r, full.x, full.router_logits, str(device)), ar)
            b = own.bound.cpu()
            index = torch.tensor(rows)
            part = torch.zeros(full.x.shape, dtype=torch.float64).index_add_(0, index, out.to(torch.float64))
            unwritten |= torch.zeros(full.x.shape, dtype=torch.int32).index_add_(0, index, left.to(torch.int32)) > 0
        bounds.append(b)
        rigorous.append(own.rigorous.cpu())
        partials.append(part)
        owns.append(own.terms)
    reduction = reduction_bound(partials, d.arithmetic.precision.output)
    bound, rig = sum(bounds) + reduction, sum(rigorous) + reduction
    ref = exact.ref.cpu()
    worst, worst_rank = None, 0
    finals = [f for _, _, f in gathered]
    if plan.mode == "ep":  # every rank's own tokens' rows make the layer's output
        finals = [torch.cat(finals)]
    for r, got in enumerate(finals):
        m = compare(got, ref, bound, unwritten)
        m.over_rigorous = int(((got.to(torch.float64) - ref).abs() > rig).sum())
        if worst is None or (m.worst_ratio, m.over_bound) > (worst.worst_ratio, worst.over_bound):
            worst, worst_rank = m, r
    # the projections and the energy test on the worst output, where the ranks ran (a GPU: the
    # spectral norms and projections of gpt-oss-120b take minutes on a CPU)
    combined = Bounded(ref=exact.ref, rigorous=rig.to(device), probabilistic=bound.to(device),
                       terms=combined_terms(plan, exact.terms, owns, reduction.to(device)))  # fmt: skip
    record_beyond_bound(full.weights, combined, finals[worst_rank].to(device), worst)
    result = Result(job["test_id"], d.id, job["arch"], plan.case, "PASS", metrics=worst)
    judge(backend, result)
    where = f"rank {worst_rank}'s output" if plan.mode == "tp" else "the combined output"
    _write(job, result.outcome, f"{where}: {result.reason}", worst.to_dict(), "")


def combined_terms(plan: Plan, exact: SlotTerms | None, owns: list[SlotTerms | None],
                   reduction: torch.Tensor) -> SlotTerms | None:  # fmt: skip
    """The slot terms of the combined output, for the tests beyond the bound: the unsharded
    layer's directions (its slots' outputs, ids and weights), each rank's activation errors where
    its slice or its experts are (TP: rank r's first ``hi - lo`` intermediate columns, the rest its
    padding; EP: its own slots, zero elsewhere), and per element the ranks' independent errors
    summed with the reduction's rounding, itself one independent error per element."""
    if exact is None or any(o is None for o in owns):
        return None
    dev = exact.ids.device
    widths = [hi - lo for lo, hi in (tp_shard(plan.case.intermediate, plan.world, r) for r in range(plan.world))]

    def here(t: torch.Tensor) -> torch.Tensor:  # every rank's terms where rank 0 judges
        return t.to(dev)

    def joined(name: str) -> torch.Tensor | None:
        parts = [getattr(o, name) for o in owns]
        if any(p is None for p in parts):
            return None
        if plan.mode == "tp":
            return torch.cat([here(p)[..., :w] for p, w in zip(parts, widths)], dim=-1)
        return sum(here(p) for p in parts)

    return SlotTerms(
        ids=exact.ids, slot_out=exact.slot_out, weight=exact.weight,
        intermediate=joined("intermediate"), intermediate_sq=joined("intermediate_sq"),
        variance=sum(here(o.variance) for o in owns) + reduction**2, coherent=sum(here(o.coherent) for o in owns),
        mean=sum(here(o.mean) for o in owns),
        bias13_effect=joined("bias13_effect") if exact.bias13_effect is not None else None,
    )  # fmt: skip


def _write(job: dict, outcome: str, reason: str, metrics: dict | None, tb: str) -> None:
    from mxmoe.harness.run.results import finite_json

    text = json.dumps(finite_json({"outcome": outcome, "reason": reason, "metrics": metrics, "traceback": tb}),
                      allow_nan=False)  # fmt: skip
    with open(job["out"], "w", encoding="utf-8") as f:
        f.write(text)
