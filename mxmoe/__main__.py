"""``python -m mxmoe`` is the installed spelling of ``python -m harness``."""

from mxmoe.harness.cli import main

raise SystemExit(main())
