"""mxmoe: a differential testing harness for MXFP4 Mixture-of-Experts kernels.

The project's folders (``harness/``, ``reference/``, ``kernels/``, ``reports/``) sit at the top of
the repository, as the design lays them out, but they are imported as ``mxmoe.harness``,
``mxmoe.reference``, ... so that none of those generic names is ever a top-level module in a
user's environment (Hugging Face ships a top-level ``kernels``; ``harness`` and ``reference`` are
taken too). An install places them inside this package; in a checkout this package's search path
is extended to the repository root, which holds them.
"""

import os as _os

_here = _os.path.dirname(_os.path.abspath(__file__))
if not _os.path.isdir(_os.path.join(_here, "reference")):
    # A checkout: the subpackages live beside this folder, at the repository root.
    __path__.append(_os.path.dirname(_here))  # noqa: F821 (module __path__ is defined for packages)

__version__ = "0.1.0"
