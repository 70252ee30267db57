"""``python -m harness`` (installed: ``mxmoe``): the harness's command line.

* ``signoff``: the main job on this machine: the oracle's self-check on built-in cases (a failure
  there stops everything: the oracle cannot be trusted here), then ``check`` of the default
  backends over the pr profile on this host's architecture (on a GPU also the nightly profile's
  gpt-oss cases, T = 1 to 4096: production kernels at production shapes), the catalogue of faulty
  kernels, the padding audit, ``model-check`` and GPQA of the tiny GPT-OSS through each default
  backend that runs here, and the sign-off report built from those records (``report``). What each
  step did is written to ``signoff-steps.json``; a step that failed or did not run blocks.
* ``bench-reference``: times the reference layer at gpt-oss shapes next to a float64 matmul.
* ``backends``: every backend (built-in, installed entry points, files) and whether it runs here.
* ``check``: a sweep of backends x a profile's cases in crash-proof worker processes, recorded in a
  results folder with a reproducer for every FAIL and ERROR.
* ``replay``: rerun one reproducer.
* ``fetch``: vendor code that is not a package (OpenAI triton_kernels from a vLLM wheel; vLLM's
  Python sources) into the git-ignored cache (``harness.upstream.fetch``, ``harness.upstream.vllm_drift``).
* ``vllm-drift``: vLLM's own MXFP4 oracle, run under fake platforms, against the declarations.
* ``model-check``, ``make-tiny``: model-level checks of GPT-OSS (``harness.cli.model``).
* ``gpqa``: GPQA through lm-eval, in this process or against a server (``harness.cli.gpqa``).
* ``diagnose``, ``shrink``: name the catalogue fault that explains a reproducer's failure; cut it
  down to the smallest failing slice of its inputs (``harness.diagnosis``).
* ``dist-check``: a layer sharded over ranks (TP or EP) with torch.distributed (``harness.distributed``).
* ``report``: merge result folders of many jobs and hosts into the sign-off report (``reports``).
* ``setup-gpu``: fetch and build what this GPU machine's production kernels need, each only where
  missing (``harness.upstream.gpu_setup``); ``./dev signoff`` runs it first on a GPU.
* ``bundle``: the same pieces in one folder, for a GPU machine without network
  (``harness.upstream.bundle``; there ``./dev signoff --device cuda --offline BUNDLE``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mxmoe.harness.cli import (
    backends,
    bench,
    build_flashinfer,
    build_vllm_ops,
    bundle,
    check,
    diagnose,
    distributed,
    drift,
    fetch,
    gpqa,
    model,
    mutants,
    padding,
    replay,
    report,
    selection,
    setup_gpu,
    signoff,
    vllm_cross,
)
from mxmoe.harness.cli.args import dispatch

COMMANDS = (signoff, bench, selection, mutants, padding, backends, check, fetch, drift, replay, model, gpqa,
            distributed, diagnose, report, build_flashinfer, build_vllm_ops, setup_gpu, bundle,
            vllm_cross)  # fmt: skip
"""The command modules, in the order ``--help`` lists their subcommands; each adds its own
(``add_parsers``)."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and documentation)."""
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    from mxmoe.harness.audits.bench import MODEL_SHAPES
    from mxmoe.harness.contract.platforms import use_triton_interpreter_without_gpu

    use_triton_interpreter_without_gpu()  # before anything imports triton; worker processes inherit it
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("bench-reference", "bench-backend"):
        unknown = [m for m in args.models if m not in MODEL_SHAPES]
        if unknown:
            parser.error(f"--models: unknown {', '.join(unknown)}; accepted values are {', '.join(MODEL_SHAPES)}")
    return dispatch(args)


if __name__ == "__main__":
    sys.exit(main())
