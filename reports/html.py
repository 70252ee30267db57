"""``signoff.html``: one self-contained page (inline CSS, plots as embedded PNGs, no script, no
font or image fetched) rendered with jinja2 from the report alone, so that it opens from a CI
artifact on a machine with no network.

The plots (matplotlib, Agg) are the ones a reviewer reads before any table: the error/bound
distribution of every backend against the 1.0 line, a backend x case heatmap, GPQA accuracy with
its intervals against the thresholds, the per-layer error/bound of each model check, and the
padding waste per TP. A plot with no data says so in words instead of showing an empty frame.
"""

from __future__ import annotations

import base64
import io
import math
from pathlib import Path

from mxmoe.reports import render

TEMPLATE = Path(__file__).with_name("templates") / "signoff.html.j2"
COLORS = {"PASS": "#1f77b4", "FAIL": "#d62728", "XPASS": "#ff7f0e", "XFAIL": "#9467bd", "ERROR": "#000000"}


def _png(fig: object) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _finite(values: list[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v) and v > 0]


def ratio_distribution(report: dict) -> str | None:
    """Worst error/bound of every judged case, one column per backend and arch, log scale, with the
    1.0 line (above it: outside the bound)."""
    import matplotlib.pyplot as plt

    groups: dict[str, list[dict]] = {}
    for c in report["cases"]:
        if c["outcome"] in ("PASS", "FAIL", "XPASS", "XFAIL") and c["worst_ratio"] is not None:
            groups.setdefault(f"{c['backend']}\n{c['arch']}", []).append(c)
    if not groups:
        return None
    finite = _finite([c["worst_ratio"] for cs in groups.values() for c in cs])
    top = max([*finite, 1.0]) * 3
    floor = min([*finite, 1.0]) / 3
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(groups) + 2), 4.2))
    for i, (_, cs) in enumerate(sorted(groups.items())):
        values = [min(max(c["worst_ratio"], floor), top) for c in cs]
        ax.boxplot([values], positions=[i], widths=0.5, showfliers=False)
        for j, (c, v) in enumerate(zip(cs, values)):
            jitter = ((j * 0.6180339) % 1 - 0.5) * 0.35  # deterministic spread, no RNG
            marker = "^" if not math.isfinite(c["worst_ratio"]) else "o"
            ax.scatter(i + jitter, v, s=14, color=COLORS.get(c["outcome"], "gray"), marker=marker, alpha=0.75,
                       zorder=3)  # fmt: skip
    ax.axhline(1.0, color="#d62728", linestyle="--", linewidth=1.2, label="bound (error/bound = 1)")
    ax.set_yscale("log")
    ax.set_ylim(floor, top)
    ax.set_xticks(range(len(groups)), sorted(groups), fontsize=8, rotation=30, ha="right")
    ax.set_ylabel("worst |got - ref| / bound per case")
    ax.set_title("Error against the derived bound, per backend\n(one dot per case; red: FAIL; ^: infinite; an exact "
                 "result, ratio 0, sits on the bottom edge)", fontsize=10)  # fmt: skip
    ax.legend(loc="upper right", fontsize=8)
    return _png(fig)


def heatmap(report: dict) -> str | None:
    """Backend x case: log10 of the worst error/bound (white: not run, grey: SKIP, black: ERROR)."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap, TwoSlopeNorm

    cases = report["cases"]
    rows = sorted({f"{c['backend']} ({c['arch']})" for c in cases if c["outcome"] != "SKIP"})
    if not rows:
        return None
    cols = sorted({c["case_id"] for c in cases if f"{c['backend']} ({c['arch']})" in rows})
    value = np.full((len(rows), len(cols)), np.nan)
    status = np.zeros((len(rows), len(cols)))  # 0 not run, 1 SKIP, 2 ERROR
    ri, ci = {r: i for i, r in enumerate(rows)}, {c: i for i, c in enumerate(cols)}
    for c in cases:
        key = f"{c['backend']} ({c['arch']})"
        if key not in ri:
            continue
        i, j = ri[key], ci[c["case_id"]]
        if c["outcome"] == "SKIP":
            status[i, j] = 1
        elif c["outcome"] == "ERROR" or c["worst_ratio"] is None:
            status[i, j] = 2
        else:
            value[i, j] = math.log10(min(max(c["worst_ratio"], 1e-3), 1e3))
    fig, ax = plt.subplots(figsize=(min(24.0, max(7.0, 0.22 * len(cols) + 3)), max(2.5, 0.4 * len(rows) + 1.8)))
    ax.imshow(np.where(status == 0, np.nan, status), cmap=ListedColormap(["#dddddd", "#000000"]), vmin=1, vmax=2,
              aspect="auto", interpolation="nearest")  # fmt: skip
    im = ax.imshow(value, cmap="RdYlBu_r", norm=TwoSlopeNorm(vmin=-3, vcenter=0, vmax=3), aspect="auto",
                   interpolation="nearest")  # fmt: skip
    fig.colorbar(im, ax=ax, label="log10 worst error/bound (0: at the bound)", fraction=0.03)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    step = max(1, len(cols) // 60)
    ax.set_xticks(range(0, len(cols), step), cols[::step], rotation=90, fontsize=6)
    ax.set_title("Backend x case (grey: SKIP, black: ERROR, white: not in this backend's run; ratio 0, an exact "
                 "result such as no tokens, at -3)", fontsize=10)  # fmt: skip
    return _png(fig)


def gpqa_plot(report: dict) -> str | None:
    """GPQA accuracy with its 95% interval per run, against each run's threshold."""
    import matplotlib.pyplot as plt

    runs = [g for g in report["gpqa"] if g["accuracy"] is not None]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.45 * len(runs) + 1.5)))
    for i, g in enumerate(runs):
        color = COLORS.get(g["outcome"], "gray")
        ax.errorbar(g["accuracy"], i, xerr=[[g["accuracy"] - g["low"]], [g["high"] - g["accuracy"]]], fmt="o",
                    color=color, capsize=4)  # fmt: skip
        if g["threshold"] is not None:
            ax.plot([g["threshold"]] * 2, [i - 0.4, i + 0.4], color="#d62728", linewidth=2)
    ax.plot([], [], color="#d62728", linewidth=2, label="threshold")
    ax.set_yticks(range(len(runs)), [f"{g['backend']} ({g['arch']})\n{g['task']}, n={g['samples']}" for g in runs],
                  fontsize=8)  # fmt: skip
    ax.set_xlim(0, 1.02)
    ax.set_xlabel("accuracy (95% interval; red marks: threshold)")
    ax.set_title("GPQA accuracy per backend")
    ax.legend(loc="lower left", fontsize=8)
    ax.invert_yaxis()
    return _png(fig)


def layers_plot(report: dict) -> str | None:
    """Worst error/bound of every layer of each model check."""
    import matplotlib.pyplot as plt

    checks = [m for m in report["model_checks"] if m["layers"]]
    if not checks:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    values = _finite([v["worst_ratio"] for m in checks for v in m["layers"]])
    top = max([*values, 1.0]) * 3
    for m in checks:
        xs = [v["layer"] for v in m["layers"]]
        ys = [min(v["worst_ratio"], top) if v["worst_ratio"] is not None else top for v in m["layers"]]
        planted = "".join(f", layer {n}: {p}" for n, p in sorted(m["planted"].items()))
        ax.plot(xs, ys, marker="o", label=f"{m['backend']} ({m['arch']}{planted})")
        for v, y in zip(m["layers"], ys):
            if v["outcome"] != "PASS":
                ax.scatter(v["layer"], y, s=80, facecolors="none", edgecolors="#d62728", zorder=3)
    ax.axhline(1.0, color="#d62728", linestyle="--", linewidth=1.2, label="bound")
    ax.set_yscale("log")
    ax.set_ylim(top=max(top, 2.0))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("layer")
    ax.set_ylabel("worst error/bound")
    ax.set_title("Model check: each MoE layer on the model's own activations (circled: not PASS)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _png(fig)


def padding_plot(report: dict) -> str | None:
    """Weight memory wasted by each backend's padding, per TP, one panel per model."""
    import matplotlib.pyplot as plt

    rows = report["padding"]
    if not rows:
        return None
    models = sorted({r["model"] for r in rows})
    backends = sorted({r["backend"] for r in rows})
    tps = sorted({r["tp"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    width = 0.8 / len(backends)
    for ax, model in zip(axes[0], models):
        for k, b in enumerate(backends):
            waste = {r["tp"]: 100 * r["waste"] for r in rows if r["model"] == model and r["backend"] == b}
            ax.bar([i + k * width for i in range(len(tps))], [waste.get(t, 0) for t in tps], width, label=b)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tps))], [f"TP{t}" for t in tps])
        ax.set_ylabel("padding waste (% of the unpadded weights)")
        ax.set_title(model)
    axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _png(fig)


PLOTS = (
    ("ratios", "Error/bound per backend", ratio_distribution),
    ("heatmap", "Backend x case", heatmap),
    ("gpqa", "GPQA accuracy", gpqa_plot),
    ("layers", "Model check per layer", layers_plot),
    ("padding", "Padding waste per TP", padding_plot),
)


def html(report: dict) -> str:
    """The page (see the module docstring)."""
    import jinja2
    import matplotlib


    matplotlib.use("Agg")
    plots = [{"id": key, "title": title, "src": fn(report)} for key, title, fn in PLOTS]
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["ratio"] = render.ratio
    template = env.from_string(TEMPLATE.read_text(encoding="utf-8"))
    return template.render(r=report, plots=plots, ran=render.ran, gpqa_cell=render.gpqa_cell,
                           model_check_cell=render.model_check_cell, padding_cell=render.padding_cell,
                           bits_cell=render.bits_cell, build_cell=render.build_cell,
                           production_line=render.production_line, headline=render.headline)  # fmt: skip
