"""What the command modules share: argparse types, ``UsageError`` and how a parsed command runs
(``dispatch``), the backends of ``--backend-file`` (``discover``) and the host line every
command prints first (``host_line``)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mxmoe.harness.run.registry import Loaded


class UsageError(Exception):
    """A bad argument found after parsing (a --backend pattern that matches nothing): reported by
    the subcommand's parser, as argparse reports its own errors."""


def dispatch(args: argparse.Namespace) -> int:
    """Run the parsed command (``args.fn``); a UsageError it raises is reported by its parser."""
    try:
        return args.fn(args)
    except UsageError as exc:
        args.parser.error(str(exc))  # exits with status 2, naming the subcommand


BACKEND_FILE_HELP = "a backend class in a file, PATH.py:ClassName (repeatable)"


def device(value: str) -> str:
    """argparse type for --device: cpu, cuda or cuda:N, and only where it exists."""
    dev = value.strip()
    if dev != "cpu" and not (dev == "cuda" or dev.startswith("cuda:")):
        raise argparse.ArgumentTypeError(f"accepted values are cpu, cuda, cuda:N; got {value!r}")
    if dev != "cpu" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{value!r} asked for, but torch {torch.__version__} sees no CUDA device")
    return dev


def int_list(value: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if not out or any(v < 0 for v in out):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {value!r}")
    return out


def count(value: str) -> int:
    """argparse type for a count that may be 0."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}")
    return n


def arch(value: str) -> str:
    """argparse type for --arch: one of the architecture tokens."""
    from mxmoe.harness.contract.platforms import ARCHS

    if value not in ARCHS:
        raise argparse.ArgumentTypeError(f"accepted values are {', '.join(ARCHS)}; got {value!r}")
    return value


def flashinfer_version(value: str) -> str:
    """argparse type for --flashinfer-version: a flashinfer-python release the harness knows
    (``flashinfer_releases.INDEX_RELEASES``)."""
    from mxmoe.harness.upstream.flashinfer_releases import check_release

    try:
        return check_release(value.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def backend_file(value: str) -> str:
    """argparse type for --backend-file: ``path/to/file.py:ClassName`` naming an existing file (a
    file that exists but fails to import is not an argument error: its cases become ERRORs)."""
    path, _, cls = value.rpartition(":")
    if not path.endswith(".py") or not cls.isidentifier():
        raise argparse.ArgumentTypeError(f"expected PATH.py:ClassName, got {value!r}")
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"no such file {path!r} (in {value!r})")
    return value


def workers(value: str) -> int | str:
    """argparse type of ``--workers``: a positive count, or ``auto`` (``platforms.auto_workers``)."""
    if value == "auto":
        return value
    try:
        return int(positive(int)(value))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive int or 'auto', got {value!r}") from None


def positive(kind: type) -> Callable[[str], float]:
    """argparse type for counts and seconds: zero workers or a zero timeout is a typo, not a plan."""

    def parse(value: str) -> float:
        try:
            out = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {value!r}") from None
        if out <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {value!r}")
        return out

    return parse


def plant(value: str) -> tuple[int, str]:
    """argparse type for --plant LAYER=BACKEND_ID."""
    layer, sep, ident = value.partition("=")
    if not sep or not layer.strip().isdigit() or not ident.strip():
        raise argparse.ArgumentTypeError(f"expected LAYER=BACKEND_ID (e.g. 2=mutant-one-scale-byte), got {value!r}")
    return int(layer), ident.strip()


def discover(args: argparse.Namespace) -> list[Loaded]:
    """Every backend, with those of ``--backend-file``; two backends with one id is a usage error."""
    from mxmoe.harness.run import registry

    try:
        loaded = registry.discover(tuple(args.backend_file))
    except ValueError as exc:  # two backends with one id
        raise UsageError(f"--backend-file: {exc}") from None
    warn_load_failures(loaded)
    return loaded


def warn_load_failures(loaded: list[Loaded]) -> None:
    """Name each backend that failed to load, with its file, class and exception, on stderr: its
    class stands in the run under a made-up id, and the reason must not wait for its first case."""
    from mxmoe.harness.run.registry import load_failures

    for line in load_failures(loaded):
        print(f"warning: backend {line} (each of its cases is an ERROR carrying the traceback)", file=sys.stderr)


def host_line(device: str) -> str:
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else platform.processor()
    return f"host: {platform.node()} | device {device} ({gpu or 'cpu'}) | torch {torch.__version__}"
