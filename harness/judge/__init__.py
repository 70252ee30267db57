"""Judging one output: the per-element bound (``bounds``), the engine that runs a backend on a
case under guards and turns what it does into a verdict (``engine``), and the systematic-error test
that catches faults too small for the bound (``systematic``)."""
