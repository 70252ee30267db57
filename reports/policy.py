"""The sign-off policy: the verdict's rules as data.

The default is ``policy.toml`` beside this module; it documents every key. A user's file is read
over it (keys left out keep their defaults), strictly: an unknown table or key, or a value of the
wrong type, is a ``PolicyError`` naming it and what is accepted, because a typo in a release
policy that silently falls back to a default would sign off on rules nobody chose.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import sys
from pathlib import Path

from mxmoe.harness.run.contention import CONTENTIONS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULT_FILE = Path(__file__).with_name("policy.toml")
NAMED = {"default": DEFAULT_FILE, "kernels-only": Path(__file__).with_name("policy-kernels-only.toml")}
"""Policies shipped with the harness, by the name ``--policy`` takes in place of a file."""
EVIDENCE = {
    "kernels": "kernel checks",
    "catalogue": "fault catalogue",
    "padding": "padding audit",
    "model-check": "model check",
    "gpqa": "GPQA with power",
}
"""The kinds of evidence a SHIP rests on, and their names in the headline and the reasons; every
kind but ``kernels`` may be waived (``[evidence] waive``)."""
WAIVABLE = tuple(k for k in EVIDENCE if k != "kernels")
REQUIRED_CASES = ("pr", "nightly", "any")
"""``[required] cases``: a profile whose cases (those the backend declares on the arch) a required
backend must all have run, or ``any`` (one case run is enough)."""
SCHEMA = 1


class PolicyError(ValueError):
    """A policy file that cannot be used; the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class Policy:
    """The rules ``reports.verdict`` applies (see ``policy.toml`` for what each means)."""

    block_backends: tuple[str, ...]
    block_xpass: bool
    block_flaky: bool
    required_backends: tuple[str, ...]
    required_archs: tuple[str, ...]
    required_cases: str
    gpqa_block: bool
    gpqa_min_drop: float
    gpqa_power: float
    faults_block: bool
    model_check_block: bool
    baseline_block_accuracy_regression: bool
    baseline_alpha: float
    evidence_waive: tuple[str, ...]
    races_backends: tuple[str, ...]
    races_rate: float
    races_confidence: float
    races_block_short: bool
    races_contention: str
    source: str

    def blocks(self, backend: str) -> bool:
        """Whether a FAIL or ERROR of ``backend`` blocks."""
        return any(fnmatch.fnmatchcase(backend, p) for p in self.block_backends)

    def required(self, backend: str) -> bool:
        """Whether ``backend`` must have run."""
        return any(fnmatch.fnmatchcase(backend, p) for p in self.required_backends)

    def hunted(self, backend: str) -> bool:
        """Whether the sign-off hunts races in ``backend`` (a production kernel matching ``[races]``)."""
        return any(fnmatch.fnmatchcase(backend, p) for p in self.races_backends)

    def evidence(self) -> tuple[str, ...]:
        """The evidence kinds a SHIP needs under this policy (``EVIDENCE`` less the waived)."""
        return tuple(k for k in EVIDENCE if k not in self.evidence_waive)

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


# (table, key) -> (field, type); the accepted keys are exactly these.
_KEYS: dict[tuple[str, str], tuple[str, type]] = {
    ("block", "backends"): ("block_backends", list),
    ("block", "xpass"): ("block_xpass", bool),
    ("block", "flaky"): ("block_flaky", bool),
    ("required", "backends"): ("required_backends", list),
    ("required", "archs"): ("required_archs", list),
    ("required", "cases"): ("required_cases", str),
    ("gpqa", "block"): ("gpqa_block", bool),
    ("gpqa", "min_drop"): ("gpqa_min_drop", float),
    ("gpqa", "power"): ("gpqa_power", float),
    ("faults", "block"): ("faults_block", bool),
    ("model_check", "block"): ("model_check_block", bool),
    ("baseline", "block_accuracy_regression"): ("baseline_block_accuracy_regression", bool),
    ("baseline", "alpha"): ("baseline_alpha", float),
    ("evidence", "waive"): ("evidence_waive", list),
    ("races", "backends"): ("races_backends", list),
    ("races", "rate"): ("races_rate", float),
    ("races", "confidence"): ("races_confidence", float),
    ("races", "block_short"): ("races_block_short", bool),
    ("races", "contention"): ("races_contention", str),
}

_CHOICES: dict[str, tuple[str, ...]] = {"required_cases": REQUIRED_CASES, "races_contention": tuple(CONTENTIONS)}
"""The values a key of type str accepts."""


def _read(path: Path) -> dict:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PolicyError(f"--policy {path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"--policy {path}: not TOML ({exc})") from None
    return data


def _apply(values: dict[str, object], data: dict, where: str) -> None:
    tables = sorted({t for t, _ in _KEYS})
    for table, body in data.items():
        if table == "schema":
            if body != SCHEMA:
                raise PolicyError(f"{where}: schema {body!r}; this harness reads policy schema {SCHEMA}")
            continue
        if table not in tables:
            accepted = ", ".join(f"[{t}]" for t in tables)
            raise PolicyError(f"{where}: unknown table [{table}]; accepted: schema, {accepted}")
        if not isinstance(body, dict):
            raise PolicyError(f"{where}: {table} must be a table ([{table}])")
        for key, value in body.items():
            if (table, key) not in _KEYS:
                accepted = ", ".join(k for t, k in _KEYS if t == table)
                raise PolicyError(f"{where}: unknown key {table}.{key}; accepted in [{table}]: {accepted}")
            name, kind = _KEYS[(table, key)]
            if kind is list:
                if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                    raise PolicyError(f"{where}: {table}.{key} must be a list of non-empty strings, got {value!r}")
                unknown = [v for v in value if v not in WAIVABLE]
                if name == "evidence_waive" and unknown:
                    why = " (a SHIP always rests on kernel checks)" if "kernels" in unknown else ""
                    raise PolicyError(f"{where}: {table}.{key} takes {', '.join(WAIVABLE)}; got {unknown[0]!r}{why}")
                value = tuple(value)
            elif kind is float:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
                    raise PolicyError(f"{where}: {table}.{key} must be a number in (0, 1), got {value!r}")
                value = float(value)
            elif kind is str:
                if value not in _CHOICES[name]:
                    accepted = ", ".join(_CHOICES[name])
                    raise PolicyError(f"{where}: {table}.{key} must be one of {accepted}, got {value!r}")
            elif not isinstance(value, kind):
                raise PolicyError(f"{where}: {table}.{key} must be true or false, got {value!r}")
            values[name] = value


def load_policy(path: str | Path | None = None) -> Policy:
    """The default policy, with the keys of ``path`` (a file, or a name of ``NAMED``) over it."""
    values: dict[str, object] = {}
    _apply(values, _read(DEFAULT_FILE), str(DEFAULT_FILE))
    source = "default (reports/policy.toml)"
    if str(path) in NAMED and not Path(str(path)).exists():
        named = NAMED[str(path)]
        _apply(values, _read(named), f"--policy {path} ({named.name})")
        source = f"{path} (reports/{named.name})"
    elif path is not None:
        if not Path(path).exists():
            raise PolicyError(f"--policy {path}: no such file, and not a policy's name ({', '.join(NAMED)})")
        _apply(values, _read(Path(path)), f"--policy {path}")
        source = str(path)
    missing = [name for name, _ in _KEYS.values() if name not in values]
    if missing:  # the shipped default lost a key: a packaging error, not the user's
        raise PolicyError(f"{DEFAULT_FILE}: no value for {', '.join(missing)}")
    return Policy(**values, source=source)
