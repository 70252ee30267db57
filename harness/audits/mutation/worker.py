"""One copy of a vendor package (patched or not) through the registry's adapters, in a process of
its own: ``python -m mxmoe.harness.audits.mutation.worker --vendor V --root DIR --backend ID ...``.

A fresh process because the adapters import the vendor by its package name once per process
(and Triton compiles per source): the copy at ``--root`` is put first on ``sys.path`` and
imported before anything else, and the worker refuses to run if the name resolves elsewhere.
Appends one JSON line per (backend, case) to ``--out`` as it goes (a patched kernel may take the
process down with it, a CUDA device-side assert for one: the parent then knows which check was
running), with a digest of the output for the parent's bit-for-bit comparison with the
unpatched copy."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Run the checks; the records go to ``--out``."""
    ap = argparse.ArgumentParser(prog="python -m mxmoe.harness.audits.mutation.worker")
    ap.add_argument("--vendor", required=True)
    ap.add_argument("--root", required=True, type=Path)
    ap.add_argument("--backend", action="append", required=True)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--case", action="append", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tactics", default="default")
    ap.add_argument("--save", type=Path, help="the control: keep each output here for the patched copies")
    ap.add_argument("--baseline", type=Path, help="a patched copy: the control's outputs, to judge each change alone")
    args = ap.parse_args(argv)

    from mxmoe.harness.audits.mutation.patched import vendor
    from mxmoe.harness.contract.platforms import host_arch, use_triton_interpreter_without_gpu

    v = vendor(args.vendor)
    use_triton_interpreter_without_gpu()
    sys.path.insert(0, str(args.root))
    interpreted = host_arch() == "cpu" and v.interpret_as is not None
    if interpreted:
        from mxmoe.harness.audits.mutation import interpret

        interpret.round_bf16_to_nearest()
        mod = interpret.import_as(v.package, v.interpret_as, v.target_modules)
        interpret.emulate_host(v.interpret_as)
    else:
        mod = importlib.import_module(v.package)
    where = Path(mod.__file__).resolve()
    if args.root.resolve() not in where.parents:
        raise SystemExit(f"{v.package} resolves to {where}, not the copy under {args.root}")

    import torch

    from mxmoe.harness.audits.catalogue import PEER_RULES
    from mxmoe.harness.audits.mutation.patched import effect_alone
    from mxmoe.harness.contract.inputs import make_inputs
    from mxmoe.harness.contract.platforms import device_for
    from mxmoe.harness.judge.bounds import reference_and_bound
    from mxmoe.harness.judge.engine import peer_verdicts, run_case
    from mxmoe.harness.run.profiles import profile_cases
    from mxmoe.harness.run.registry import discover, select, with_tactics

    arch = v.interpret_as if interpreted else host_arch()
    device = "cpu" if interpreted else device_for(arch)
    wanted = set(args.case)
    cases = [c for c in profile_cases(args.profile) if c.id in wanted]
    backends = [item.backend for item in with_tactics(select(discover(), tuple(args.backend)), args.tactics)]
    args.out.write_text("")
    for case in cases:
        inputs, bounds = None, {}
        for backend in backends:
            seen: dict[str, torch.Tensor] = {}
            run = backend.run

            def recording(
                prepared: object, inp: object, out: torch.Tensor, run: object = run, seen: dict = seen
            ) -> None:
                run(prepared, inp, out)
                seen["out"] = out

            backend.run = recording  # the engine calls backend.run: keep the output it judged
            try:
                if inputs is None and not backend.supports(case, arch):
                    inputs = make_inputs(case, device)
                arith = backend.declaration.arithmetic
                if inputs is not None and arith not in bounds:
                    bounds[arith] = reference_and_bound(inputs, arith)
                result, _ = run_case(backend, case, arch, inputs=inputs, bounded=bounds.get(arith))
            finally:
                del backend.run
            m = result.metrics
            out = seen.get("out")
            digest, effect = "none", None
            if out is not None and result.outcome != "ERROR":
                digest = hashlib.sha256(out.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()
                name = f"{backend.declaration.id}__{case.id}.pt"
                if args.save:
                    torch.save(out.detach().cpu(), args.save / name)
                base = args.baseline / name if args.baseline else None
                bounded = bounds.get(arith)
                if base is not None and base.is_file() and bounded is not None:
                    before = torch.load(base).to(out.device)
                    same = before.shape == out.shape and torch.equal(
                        before.contiguous().view(torch.uint8), out.detach().contiguous().view(torch.uint8))  # fmt: skip
                    if not same and before.shape == bounded.ref.shape == out.shape:  # judge what changed
                        e = effect_alone(inputs.weights, bounded, out.double() - before.double())
                        effect = dataclasses.asdict(e) | {"material": e.material}
            record = {
                "backend": backend.declaration.id, "case": case.id, "outcome": result.outcome,
                "reason": result.reason, "worst_ratio": m.worst_ratio, "over_bound": m.over_bound,
                "z": m.systematic_z, "z_fired": m.beyond_bound_fired, "energy": m.energy_ratio,
                "peers": peer_verdicts(m) if result.outcome != "ERROR" else dict.fromkeys(PEER_RULES, True),
                "digest": digest, "effect": effect, "interpreted": interpreted,
            }  # fmt: skip
            with args.out.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"{backend.declaration.id} {case.id} {result.outcome} {result.reason[:160]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
