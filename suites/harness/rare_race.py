"""A kernel written apart from the project that races: right on most calls, and on about 1 call in
100, at random (the operating system's entropy, no seed), one tile of its output comes out wrong,
as a grouped GEMM's tile does when a scale load reads a descriptor another group is rewriting.
Two runs of a check meet it about 2 times in 100; the sign-off's race hunt is built to meet it.

``python -m harness check --backend-file suites/harness/rare_race.py:RareTileRace --backend rare-tile-race
--race-power 0.01,0.999`` (the sign-off's kernel check's flags for a hunted kernel)
"""

from __future__ import annotations

import dataclasses
import random

from mxmoe.kernels.emulation import Emulation

RATE = 0.01
"""The share of calls that come out wrong."""
TILE = (16, 128)
"""Rows and columns of the tile a wrong call spoils."""
_ENTROPY = random.SystemRandom()


class RareTileRace(Emulation):
    """The emulation's output, computed once per converted layer and copied (a real kernel computes
    it on every call; the copy keeps a hunt of hundreds of calls cheap on a CPU), with one random
    tile added 1.0 in about ``RATE`` of calls."""

    declaration = dataclasses.replace(
        Emulation.declaration, id="rare-tile-race", kind="backend", production=True,
        description="a kernel from outside the project with a race: one output tile wrong in about 1 of 100 calls",
    )  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self._for: object | None = None
        self._out = None

    def run(self, prepared, inputs, out):
        if self._for is not prepared:
            super().run(prepared, inputs, out)
            self._for, self._out = prepared, out.clone()
        out.copy_(self._out)
        rows, cols = out.shape
        if rows and cols and _ENTROPY.random() < RATE:
            r = _ENTROPY.randrange(0, rows, TILE[0]) if rows > TILE[0] else 0
            c = _ENTROPY.randrange(0, cols, TILE[1]) if cols > TILE[1] else 0
            out[r : r + TILE[0], c : c + TILE[1]] += 1.0
