"""``python -m mxmoe`` is the installed spelling of ``python -m harness``."""

from mxmoe.harness.cli.app import main

raise SystemExit(main())
