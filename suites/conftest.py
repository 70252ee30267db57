"""Suite-wide options (``--profile``, ``--backend``, ``--backend-file``, ``--results``), the
Hypothesis profiles ``pr`` and ``nightly`` and the differential parametrization all live in one
place, the harness's pytest plugin."""

pytest_plugins = ["mxmoe.harness.plugin"]
