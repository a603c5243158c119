"""PNG figures of the benchmark results (matplotlib, optional extra ``bench``).

Rules: every figure carries its own footer with the machine, versions, settings and command, so a
PNG read on its own still says what it measured. Without matplotlib no PNG is written and the
caller says so in the report; nothing else depends on it.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import cast


def available() -> str | None:
    """None when matplotlib can be used, else the reason."""
    try:
        import matplotlib  # noqa: PLC0415 - optional extra

        matplotlib.use("Agg")
    except ImportError as exc:
        return f"matplotlib not installed ({exc}); install the 'bench' extra"
    return None


def _footer(fig: object, text: str) -> None:
    wrapped = "\n".join(textwrap.wrap(text, 150))
    fig.text(0.01, 0.01, wrapped, fontsize=6, va="bottom", ha="left", family="monospace")  # type: ignore[attr-defined]


def _nan(v: object) -> float:
    return float(v) if isinstance(v, int | float) else math.nan


def routing_figure(runs: Sequence[Mapping[str, object]], ideal: float, footer: str,
                   path: Path) -> None:
    import matplotlib.pyplot as plt  # noqa: PLC0415 - optional extra

    ok = [r for r in runs if r.get("status") == "ok"]
    names = [str(r["router"]) for r in ok]
    summaries = [cast(Mapping[str, object], r["summary"]) for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 6.2))
    width = 0.27
    xs = range(len(ok))
    for k, (key, label) in enumerate((("ttft_p50", "p50"), ("ttft_p90", "p90"),
                                      ("ttft_p99", "p99"))):
        vals = [_nan(s.get(key)) for s in summaries]
        ax1.bar([x + (k - 1) * width for x in xs], vals, width, label=label)
    ax1.set_xticks(list(xs), names, rotation=35, ha="right", fontsize=8)
    ax1.set_ylabel("TTFT, seconds of engine time")
    ax1.set_yscale("log")
    ax1.set_title("Time to first token (lower is better)")
    ax1.legend()
    hits = [_nan(r.get("hit_rate")) for r in ok]
    ax2.bar(list(xs), hits, color="tab:green")
    ax2.axhline(ideal, color="black", linestyle="--",
                label=f"ideal (one infinite cache) {ideal:.3f}")
    ax2.set_xticks(list(xs), names, rotation=35, ha="right", fontsize=8)
    ax2.set_ylabel("engine-reported prefix-cache hit rate")
    ax2.set_title("Prefix-cache hit rate (higher is better)")
    ax2.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    _footer(fig, footer)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def overhead_figure(ratios: Mapping[str, Mapping[int, Mapping[str, float]]], footer: str,
                    path: Path) -> None:
    """``ratios[router][concurrency][metric]`` -> value relative to direct."""
    import matplotlib.pyplot as plt  # noqa: PLC0415 - optional extra
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415 - optional extra

    metrics = (("ttft_p50", "TTFT p50"), ("ttft_p99", "TTFT p99"), ("itl_p50", "ITL p50"),
               ("throughput_tok_s", "throughput"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(15, 5.2))
    for ax, (key, label) in zip(axes, metrics, strict=True):
        for router, by_conc in ratios.items():
            conc = sorted(by_conc)
            ax.plot(conc, [by_conc[c].get(key, math.nan) for c in conc], marker="o",
                    label=router)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(1.05, color="grey", linewidth=0.6, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # one slow peer must not flatten the others
        plain = FuncFormatter(lambda v, _pos: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_xlabel("concurrent streams")
        ax.set_title(f"{label} / direct")
    axes[0].legend(fontsize=7)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    _footer(fig, footer)
    fig.savefig(path, dpi=110)
    plt.close(fig)
