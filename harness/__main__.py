"""``python -m harness`` from a checkout (the installed spelling is ``python -m mxmoe``)."""

from mxmoe.harness.cli import main

raise SystemExit(main())
