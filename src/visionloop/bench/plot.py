"""The sweep as a picture: throughput against p99 latency, one line per configuration.

Reading it: up is more images per second, left is a lower tail latency; each point is a batch
size (labelled), so a line shows what a bigger batch buys in throughput and costs in latency.
A latency budget is a vertical line: the best choice is the highest point left of it.
"""

from __future__ import annotations

from pathlib import Path

from visionloop.bench.result import BenchResult


def plot_result(result: BenchResult, path: Path, *, budget_ms: float | None = None) -> Path | None:
    """Write the PNG (Agg backend: no display needed); None when no configuration ran."""
    rows = [c for c in result.ok_configs() if c.points]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    try:
        for row in rows:
            xs = [p.p99_ms for p in row.points]
            ys = [p.throughput_ips for p in row.points]
            (line,) = ax.plot(xs, ys, marker="o", label=row.label)
            for p in row.points:
                ax.annotate(
                    f"bs {p.batch_size}",
                    (p.p99_ms, p.throughput_ips),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=8,
                    color=line.get_color(),
                )
        if budget_ms is not None:
            ax.axvline(budget_ms, color="grey", linestyle="--", label=f"budget {budget_ms:g} ms")
        p99s = [p.p99_ms for row in rows for p in row.points]
        if min(p99s) > 0 and max(p99s) / min(p99s) > 20:
            ax.set_xscale("log")  # batch 1 and batch 64 differ by orders of magnitude
            # Plain numbers, not 10^x mathtext: that needs TeX fonts a server may lack.
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.set_xlabel("p99 latency per batch (ms)")
        ax.set_ylabel("throughput (images/s)")
        hardware = result.machine.get("gpu") or result.machine.get("cpu")
        ax.set_title(f"{result.model} ({result.arch}) on {hardware}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fig.savefig(tmp, format="png")
        tmp.replace(path)
    finally:
        plt.close(fig)
    return path
