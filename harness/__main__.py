"""``python -m harness`` from a checkout (the installed spelling is ``python -m mxmoe``)."""

from mxmoe.harness.cli.app import main

raise SystemExit(main())
