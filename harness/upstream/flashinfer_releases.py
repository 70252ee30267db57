"""Which FlashInfer release a GPU machine is set up with: the one the vLLM under test pins, where
PyPI has it, else the nearest newer release PyPI has, said so.

vLLM pins flashinfer-python exactly in its CUDA requirements (``requirements/cuda.txt``, which
become the ``Requires-Dist`` of its wheel): the release vLLM's FlashInfer backends are built and
tested against, and so the one whose kernels a vLLM user runs. The project's own FlashInfer
adapters and its SM90 subset build follow it (``NEWEST_VLLM``, the vLLM the declarations follow).
A pin is not always on PyPI: vLLM 0.34.0 pins 0.7.3, which was never published there. Then the set-up
takes the nearest newer release (the one a user who asks pip for "0.7.3 or later" gets) and says
so, rather than failing or taking an older release whose kernels vLLM moved away from.

Both tables are data, read once by hand and checked by the tests: ``VLLM_PINS`` from each vLLM
wheel's metadata, ``INDEX_RELEASES`` from ``pip index versions flashinfer-python``. Nothing here
asks the network: a GPU machine without one resolves the same way, and a release missing from
``INDEX_RELEASES`` is added here when it is published (the tests say which is the newest).
"""

from __future__ import annotations

from dataclasses import dataclass

from mxmoe.harness.upstream.fetch import NEWEST_VLLM

PACKAGE = "flashinfer-python"
VLLM_PINS: dict[str, str] = {
    "0.26.0": "0.6.14",
    "0.33.0": "0.7.2.post1",
    "0.34.0": "0.7.3",
}
"""vLLM release -> the flashinfer-python release its wheel requires (``flashinfer-python==X``)."""
INDEX_RELEASES: tuple[str, ...] = (
    "0.6.0", "0.6.1", "0.6.2", "0.6.3", "0.6.4", "0.6.5", "0.6.6", "0.6.7", "0.6.7.post1", "0.6.7.post2",
    "0.6.7.post3", "0.6.8", "0.6.8.post1", "0.6.9", "0.6.10", "0.6.10.post1", "0.6.11", "0.6.11.post1",
    "0.6.11.post2", "0.6.11.post3", "0.6.12", "0.6.13", "0.6.14", "0.6.15", "0.6.15.post1", "0.6.16",
    "0.6.16.post1", "0.6.16.post2", "0.6.16.post3", "0.6.16.post4", "0.6.17", "0.6.18", "0.6.18.post1",
    "0.7.0", "0.7.0.post1", "0.7.1", "0.7.2", "0.7.2.post1", "0.7.4",
)  # fmt: skip
"""The flashinfer-python releases PyPI has from 0.6.0 on (the harness has run none older), oldest
first; 0.7.3 is not among them."""


def version_key(version: str) -> tuple[tuple[int, ...], int]:
    """``"0.7.2.post1"`` -> ((0, 7, 2), 1): the release, then the post-release (0 for none)."""
    parts = version.split("+")[0].split(".")
    post = 0
    if parts and parts[-1].startswith("post") and parts[-1][4:].isdigit():
        post = int(parts.pop()[4:])
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a FlashInfer release: {version!r}")
    return tuple(int(p) for p in parts), post


def check_release(version: str, index: tuple[str, ...] = INDEX_RELEASES) -> str:
    """``version`` if it is a release of ``index``; else ValueError naming the accepted values."""
    if version in index:
        return version
    raise ValueError(f"{version!r} is not a {PACKAGE} release the harness knows; accepted values: {', '.join(index)}")


@dataclass(frozen=True)
class Resolution:
    """The release chosen for a vLLM release: ``pinned`` (vLLM's pin) and ``release`` (what is
    installed), which differ where PyPI (or an offline bundle) lacks the pin or another release was
    asked for (``requested``); ``note`` says why, or is empty."""

    vllm: str
    pinned: str
    release: str
    note: str = ""
    requested: bool = False


def resolve(vllm: str = NEWEST_VLLM, index: tuple[str, ...] = INDEX_RELEASES) -> Resolution:
    """The FlashInfer release for ``vllm``: its pin where ``index`` has it, else the nearest newer
    release there. ValueError where the pin is unknown or nothing newer is published."""
    if vllm not in VLLM_PINS:
        raise ValueError(f"vLLM {vllm}'s {PACKAGE} pin is not in VLLM_PINS ({', '.join(VLLM_PINS)}): read it from "
                         f"its wheel's Requires-Dist and add it (harness/upstream/flashinfer_releases.py)")  # fmt: skip
    pinned = VLLM_PINS[vllm]
    if pinned in index:
        return Resolution(vllm, pinned, pinned)
    newer = sorted((v for v in index if version_key(v) > version_key(pinned)), key=version_key)
    if not newer:
        raise ValueError(f"vLLM {vllm} pins {PACKAGE} {pinned}, which PyPI does not have, nor any newer release")
    return Resolution(vllm, pinned, newer[0], f"vLLM {vllm} pins {PACKAGE} {pinned}, which PyPI does not have; "
                                              f"using {newer[0]}, the nearest newer release")  # fmt: skip


def choose(requested: str | None, vllm: str = NEWEST_VLLM, available: tuple[str, ...] | None = None) -> Resolution:
    """``--flashinfer-version`` where given (checked against ``INDEX_RELEASES``), else ``resolve``.
    ``available``: the releases an offline bundle holds; asking for another is a ValueError, and
    without a request a bundle holding one release other than the resolved one gives that one,
    said so."""
    if requested is not None:
        check_release(requested)
        if available is not None and requested not in available:
            held = ", ".join(available) or "none"
            raise ValueError(f"{requested} is not in the bundle, which holds {PACKAGE} {held}")
        pinned = VLLM_PINS.get(vllm, "")
        note = "" if requested == pinned else f"asked for {requested}; vLLM {vllm} pins {pinned or 'an unknown one'}"
        return Resolution(vllm, pinned, requested, note, requested=True)
    out = resolve(vllm)
    if available is None or out.release in available:
        return out
    if len(available) != 1:
        raise ValueError(f"the bundle holds {PACKAGE} {', '.join(available) or 'none'}, not {out.release} (vLLM "
                         f"{vllm}'s); name one with --flashinfer-version")  # fmt: skip
    return Resolution(vllm, out.pinned, available[0], f"vLLM {vllm} would take {out.release}; the bundle holds "
                                                      f"{available[0]} alone")  # fmt: skip
