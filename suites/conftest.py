"""Suite-wide options (``--profile``, ``--backend``, ``--backend-file``, ``--results``), the
Hypothesis profiles ``pr`` and ``nightly`` and the differential parametrization all live in one
place, the harness's pytest plugin.

Every suite imports torch, and the plugin Hypothesis: an interpreter without them collects nothing,
so it says so here, with what sets them up, instead of pytest's traceback through its plugin loader."""

import sys

_missing = []
for _module in ("torch", "hypothesis"):
    try:
        __import__(_module)
    except ImportError as _exc:
        _missing.append(f"{_module} ({_exc})")
if _missing:
    raise ImportError(
        f"the suites need {' and '.join(_missing)}, which {sys.executable} cannot import. Set up with "
        "`./dev setup` (it installs the CPU torch only where none is importable, never over a CUDA or ROCm "
        "build), then run `./dev py -m pytest suites/ ...` or activate .venv, or use `./dev test`"
    )

pytest_plugins = ["mxmoe.harness.plugin"]
