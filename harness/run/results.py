"""Recorded results and reproducers: what a sign-off report is built from, and what a kernel author
reruns.

* ``Recorder`` appends one JSON line per Result, as it happens, to ``results-<host>-<pid>.jsonl``
  in a results folder: a crash loses nothing already decided, and parallel processes (pytest-xdist
  workers, ``check`` workers, CI jobs whose folders are merged) each own their file, so lines never
  interleave. ``read_results`` reads every file of a folder back.
* ``save_repro`` writes, for a FAIL or ERROR, the case's exact input tensors (safetensors: plain
  bytes, never pickle, so a reproducer from an untrusted CI artifact cannot run code) next to a
  JSON file naming the case, the backend and the command that reruns it; ``load_repro`` rebuilds
  everything ``run_case`` needs from them.

Files are strict JSON: non-finite metrics (an infinite error ratio, a NaN cosine) are written as
the strings "inf", "-inf" and "nan", which ``read_results`` turns back into floats.
"""

from __future__ import annotations

import json
import math
import os
import socket
from collections.abc import Callable
from dataclasses import fields
from datetime import datetime, timezone
from pathlib import Path

import torch

from mxmoe.harness.contract.backend import Declaration
from mxmoe.harness.contract.cases import Case
from mxmoe.harness.contract.inputs import CaseInputs, make_inputs
from mxmoe.harness.contract.platforms import device_for, host_arch, host_fingerprint
from mxmoe.harness.judge.engine import Result, bitwise_differences, checksum
from mxmoe.harness.run.registry import Loaded, load_spec
from mxmoe.reference.moe import MoEWeights

SCHEMA = 1
"""Version of the record and reproducer formats; a reader meeting another version must say so."""
REPRO_DIR = "repro"
REPRO_MAX_MB = 64
"""Default size cap of a reproducer's tensors (``MXMOE_REPRO_MAX_MB`` overrides; 0 turns the cap
off). A gpt-oss-120b case's inputs are about 2 GB: over the cap, a reproducer whose inputs are
exactly the case's own (``make_inputs`` of its id, on its device) keeps their checksums instead,
and replay regenerates and verifies them."""


def repro_cap_bytes() -> int:
    """The cap in bytes, 0 for none; a clear error for a value that is not a non-negative number."""
    raw = os.environ.get("MXMOE_REPRO_MAX_MB", str(REPRO_MAX_MB))
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb >= 0:
        raise ValueError(f"MXMOE_REPRO_MAX_MB must be a non-negative number of megabytes (0: no cap); got {raw!r}")
    return int(mb * 2**20)
_WEIGHT_NAMES = ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales", "w13_bias", "w2_bias")


def _plain(value: object) -> object:
    """JSON-ready form of a record (dataclasses as dicts, dtypes by name, tuples as lists)."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    return value


def declaration_to_dict(declaration: Declaration) -> dict[str, object]:
    """A backend's declaration as plain data, precision points included, so that a report can show
    what a backend promised next to what it did."""
    out = _plain(declaration)
    assert isinstance(out, dict)
    return out


def replay_command(json_path: Path) -> str:
    """The one line that reruns a reproducer: ``python -m harness`` in a checkout (the package's
    path then reaches the repository root), ``python -m mxmoe`` for an installed copy."""
    import mxmoe

    checkout = any(Path(p, "harness").is_dir() and Path(p, "pyproject.toml").is_file() for p in mxmoe.__path__)
    return f"python -m {'harness' if checkout else 'mxmoe'} replay {json_path}"


def stamp(kind: str) -> dict[str, object]:
    """The fields every recorded summary file carries (a GPQA run, a model check, the mutant matrix,
    the padding audit), so that a report merging many hosts' folders knows what each file is, which
    schema it speaks, when it was written and where: ``reports.collect`` rejects files without them."""
    return {
        "schema": SCHEMA,
        "kind": kind,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        "host": host_fingerprint(),
    }


def finite_json(value: object) -> object:
    """Non-finite floats as the strings "inf", "-inf" and "nan": records stay strict JSON (a
    report's JSON parser in another language must read them); ``read_results`` turns them back."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def from_json(value: object) -> object:
    """A record as read from JSON, the strings "inf", "-inf" and "nan" back as floats."""
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    if isinstance(value, dict):
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


class Recorder:
    """Appends results to ``<directory>/results-<hostname>-<pid>.jsonl``, one line per result,
    flushed and fsynced before ``record`` returns (``record_many``: once per batch)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"results-{socket.gethostname()}-{os.getpid()}.jsonl"
        self._json_ready: dict[int, tuple[object, object, object]] = {}
        """id -> (object, its plain form, its JSON-ready form) for declarations and cases: both are
        frozen, and a sweep records each of them thousands of times (109,780 records of 55
        declarations in the nightly with every tactic), so each is made plain once. The object is
        held so that its id cannot be reused by another while cached."""

    def _ready(self, obj: object, make: Callable[[object], object]) -> tuple[object, object]:
        hit = self._json_ready.get(id(obj))
        if hit is None or hit[0] is not obj:
            if len(self._json_ready) >= 8192:  # a worker's results bring their own copies of a case
                self._json_ready.clear()
            plain = _plain(make(obj))
            hit = self._json_ready[id(obj)] = (obj, plain, finite_json(plain))
        return hit[1], hit[2]

    def _line(self, result: Result, loaded: Loaded, repro: str | Path | None) -> tuple[dict[str, object], str]:
        case, case_json = self._ready(result.case, Case.to_dict)
        declaration, declaration_json = self._ready(loaded.backend.declaration, declaration_to_dict)
        rec = {
            "schema": SCHEMA,
            "test_id": result.test_id,
            "backend": result.backend,
            "backend_spec": loaded.spec,
            "arch": result.arch,
            "outcome": result.outcome,
            "reason": result.reason,
            "findings": list(result.findings),
            "diagnosis": result.diagnosis,
            "build": result.build,
            "contention": result.contention,
            "case_id": result.case.id,
            "case": case,
            "metrics": result.metrics.to_dict(),
            "traceback": result.traceback,
            "seconds": result.seconds,
            "stages": dict(result.stages),
            "device_peak_gib": result.device_peak_gib,
            "device_peak_parts": dict(result.device_peak_parts),
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "host": host_fingerprint(),
            "declaration": declaration,
            "repro": None if repro is None else str(repro),
        }
        ready = {"case": case_json, "declaration": declaration_json}
        line = {k: ready[k] if k in ready else finite_json(_plain(v)) for k, v in rec.items()}
        return rec, json.dumps(line, allow_nan=False) + "\n"

    def _append(self, text: str) -> None:
        # One write of whole lines to a file only this process appends to; fsync so that a crash of
        # the machine right after still leaves the verdicts on disk.
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def record(self, result: Result, loaded: Loaded, repro: str | Path | None = None) -> dict[str, object]:
        """Write one result; ``loaded`` is the backend it came from (its spec says where from)."""
        rec, line = self._line(result, loaded, repro)
        self._append(line)
        return rec

    def record_many(self, items: list[tuple[Result, Loaded, str | Path | None]]) -> list[dict[str, object]]:
        """Write several results, each line as ``record`` writes it, with one write and one fsync:
        a sweep's SKIPs decided without a worker (tens of thousands in a nightly) cost a disk
        flush per batch, not per test."""
        made = [self._line(result, loaded, repro) for result, loaded, repro in items]
        if made:
            self._append("".join(line for _, line in made))
        return [rec for rec, _ in made]


def read_results(directory: str | Path) -> list[dict]:
    """Every record of every ``results-*.jsonl`` in ``directory`` (files in name order, lines in
    the order written). A truncated last line (a process killed mid-write) is skipped."""
    out = []
    for path in sorted(Path(directory).glob("results-*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.endswith("\n"):
                    continue
                out.append(from_json(json.loads(line)))
    return out


def save_repro(directory: str | Path, result: Result, inputs: CaseInputs, backend_spec: str) -> Path:
    """Write ``<directory>/repro/<test_id>.safetensors`` (every input tensor, on the CPU) and
    ``<test_id>.json`` beside it; returns the JSON file's path."""
    from safetensors.torch import save_file

    folder = Path(directory).resolve() / REPRO_DIR
    folder.mkdir(parents=True, exist_ok=True)
    tensors_path = folder / f"{result.test_id}.safetensors"
    json_path = folder / f"{result.test_id}.json"
    sums = checksum(inputs.tensors())
    size = sum(t.numel() * t.element_size() for t in inputs.tensors().values())
    cap = repro_cap_bytes()
    own = bool(cap) and size > cap and make_inputs(inputs.case, inputs.x.device).tensors()
    regenerate = bool(own) and _same_bits(own, inputs.tensors())
    if regenerate:
        tensors_path.unlink(missing_ok=True)
    else:  # under the cap, or inputs that are not the case's own (a model's activations, a shrunk case)
        save_file({k: v.detach().cpu().contiguous() for k, v in inputs.tensors().items()}, str(tensors_path))
    info = {
        "schema": SCHEMA,
        "test_id": result.test_id,
        "backend": result.backend,
        "backend_spec": backend_spec,
        "arch": result.arch,
        "case_id": result.case.id,
        "case": result.case.to_dict(),
        "w13_layout": inputs.weights.w13_layout,
        "tensors": None if regenerate else tensors_path.name,
        "input_bytes": size,
        "checksums": sums,
        "inputs": (f"regenerated from the case id on {inputs.x.device.type} ({size / 2**20:.0f} MB over the "
                   f"{cap / 2**20:.0f} MB cap; MXMOE_REPRO_MAX_MB=0 keeps them)") if regenerate else "saved",
        "outcome": result.outcome,
        "reason": result.reason,
        "metrics": result.metrics.to_dict(),
        "traceback": result.traceback,
        "diagnosis": result.diagnosis,
        "build": result.build,
        "contention": result.contention,
        "replay": replay_command(json_path),
    }
    json_path.write_text(json.dumps(finite_json(_plain(info)), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return json_path


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two sets of tensors are the same bit for bit, compared where they lie (the sums of a
    gpt-oss-120b case's 1.6 GB, hashed on the CPU, cost seconds)."""
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and a[k].dtype == b[k].dtype and not bitwise_differences(a[k], b[k]) for k in a
    )


def load_repro(json_path: str | Path) -> tuple[Loaded, Case, str, CaseInputs]:
    """The backend, case, architecture and exact inputs of a reproducer. Tensors go to the arch's
    device when this host is that arch (else the CPU, and ``run_case`` will say it needs the
    hardware)."""
    from safetensors.torch import load_file

    path = Path(json_path)
    info = json.loads(path.read_text(encoding="utf-8"))
    if info.get("schema") != SCHEMA:
        raise ValueError(f"{path}: reproducer schema {info.get('schema')!r}, this harness reads {SCHEMA}")
    case = Case.from_dict(info["case"])
    arch = info["arch"]
    device = device_for(arch) if arch == host_arch() else "cpu"
    if info.get("tensors") is None:  # over the size cap: the case's own inputs, regenerated and verified
        inputs = make_inputs(case, device)
        if checksum(inputs.tensors()) != info.get("checksums"):
            raise ValueError(
                f"{path}: its inputs are regenerated from the case id, and those made here on {device} differ from "
                f"the recorded checksums: replay it on {arch} (inputs are drawn per device type), or record it "
                "again with MXMOE_REPRO_MAX_MB=0 to keep the tensors"
            )
        return load_spec(info["backend_spec"]), case, arch, inputs
    t = load_file(str(path.parent / info["tensors"]), device=device)
    weights = MoEWeights(*(t.get(n) for n in _WEIGHT_NAMES), w13_layout=info["w13_layout"])
    inputs = CaseInputs(case, t["x"], t["router_logits"], weights, t.get("expert_map"), t.get("correction_bias"))
    return load_spec(info["backend_spec"]), case, arch, inputs
