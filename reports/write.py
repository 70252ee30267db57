"""Writing the sign-off report's files: the JSON record, the Markdown and JUnit views
(``render``) and the page (``html``), in that order.
"""

from __future__ import annotations

import json
from pathlib import Path

from mxmoe.harness.run.results import finite_json
from mxmoe.reports.render import junit, markdown


class PageUnavailable(ImportError):
    """matplotlib or jinja2 is missing: the page cannot be made (the other files are written)."""


def write_report(report: dict, out: str | Path) -> dict[str, Path]:
    """Write ``signoff.json``, ``signoff.md``, ``junit.xml`` and ``signoff.html`` into ``out``. The
    first three need nothing beyond Python; the page needs matplotlib and jinja2, and is written
    last, so that their absence still leaves the others."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "signoff.json", "md": out / "signoff.md", "junit": out / "junit.xml",
             "html": out / "signoff.html"}  # fmt: skip
    paths["json"].write_text(json.dumps(finite_json(report), indent=1, allow_nan=False) + "\n")
    paths["md"].write_text(markdown(report), encoding="utf-8")
    paths["junit"].write_text(junit(report), encoding="utf-8")
    try:
        from mxmoe.reports.html import html  # matplotlib and jinja2 are imported by it, lazily

        page = html(report)
    except ImportError as exc:
        raise PageUnavailable(f"signoff.html needs matplotlib and jinja2 ({exc}): pip install "
                              f"'mxfp4-moe-harness[report]'; {out}/signoff.json, signoff.md and junit.xml are "
                              "written") from None  # fmt: skip
    paths["html"].write_text(page, encoding="utf-8")
    return paths
