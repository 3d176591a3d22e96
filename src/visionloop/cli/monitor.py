"""`visionloop monitor MODEL`: has the served traffic left what the model was validated on?
(visionloop.monitor: the reference, the windows, the drift tests, the Prometheus gauges.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.markup import escape

from visionloop.cli.console import err, out


def parse_duration(text: str, option: str) -> float:
    """'90s', '15m', '1h', '1d' (or plain seconds) → seconds (visionloop.core.durations)."""
    from visionloop.core.durations import parse_duration as seconds

    try:
        return seconds(text)
    except ValueError:
        raise typer.BadParameter(
            f"{text!r} is not a duration; write e.g. 30s, 15m, 1h or 1d", param_hint=option
        ) from None


def monitor(
    model: str = typer.Argument(
        ..., help="NAME (the champion, else the newest), NAME@ALIAS or NAME/VERSION."
    ),
    window: str | None = typer.Option(
        None, "--window", help="Windows of this duration, aligned to the clock: 15m, 1h, 1d (default 1h)."
    ),
    window_requests: int | None = typer.Option(
        None, "--window-requests", help="Windows of this many requests instead of a duration (at least 20)."
    ),
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Keep watching: judge each window as it completes."
    ),
    interval: str = typer.Option("30s", "--interval", help="With --follow: how often to read the logs."),
    alpha: float = typer.Option(0.05, "--alpha", help="False-alarm rate per window (all tests together)."),
    thin: str = typer.Option(
        "auto",
        "--thin",
        help="Keep every k-th request of a window: auto (from its autocorrelation: correlated video "
        "frames), or k (1: every request).",
    ),
    logs: Path | None = typer.Option(
        None, "--logs", help="Folder of prediction logs (default: $VISIONLOOP_HOME/serve/predictions)."
    ),
    rebuild_reference: bool = typer.Option(
        False,
        "--rebuild-reference",
        help="Build the version's reference again (else built once, when missing).",
    ),
    dataset: Path | None = typer.Option(
        None,
        "--dataset",
        help="Build the reference from this dataset (default: the one the model was trained on).",
    ),
    split: str | None = typer.Option(
        None, "--split", help="The reference's split (default: val, else test)."
    ),
    reference_images: int = typer.Option(
        2000, "--reference-images", help="At most this many reference images."
    ),
    precision: str = typer.Option(
        "fp32", "--precision", help="The served export's precision: fp32, fp16 or int8."
    ),
    metrics_port: int | None = typer.Option(
        None,
        "--metrics-port",
        help="Serve Prometheus metrics (drift p-values, estimated accuracy) on this port.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print each judged window as a JSON line."),
) -> None:
    """Compare windows of served traffic with the model version's reference and say whether it drifted.

    The reference is built once per version from its validation split, the way the server sees an image (the served ONNX export, the stored temperature): per-image statistics (brightness, contrast, sharpness, saturation, size, aspect), the model's output distribution (a classifier's class probabilities; a detector's box count and scores) and its predicted classes.

    Each complete window of the server's prediction log (--window 1h, aligned to the clock, or --window-requests N) is tested: KS on each output probability with Bonferroni correction (black-box shift detection), MMD with a permutation test on the outputs together, chi-square on the predicted classes (label shift) and KS on the image statistics (image requests). One verdict per window at --alpha for all tests together, what moved, and an accuracy estimated without labels from the calibrated confidences (ATC).

    Video frames are not independent: --thin auto keeps every k-th request of a window, k where its autocorrelation fades. Windows are judged once and recorded under $VISIONLOOP_HOME/monitor/MODEL/ (alerts read them); --follow keeps going, --metrics-port publishes Prometheus gauges.
    """  # noqa: E501 (one line per paragraph: Rich keeps the line breaks of a help text)
    from visionloop.core.settings import load_settings
    from visionloop.monitor.service import Gauges, MonitorOptions, check_options, new_windows, reference_for
    from visionloop.monitor.windows import WindowSpec

    if window is not None and window_requests is not None:
        raise typer.BadParameter("give --window or --window-requests, not both", param_hint="--window")
    spec = (
        WindowSpec(requests=window_requests)
        if window_requests is not None
        else WindowSpec(seconds=parse_duration(window or "1h", "--window"))
    )
    # isascii: str.isdigit() is also true of '²' and other digits int() does not read.
    if thin != "auto" and not (thin.isascii() and thin.isdigit()):
        raise typer.BadParameter(f"{thin!r}: write auto or a whole number such as 5", param_hint="--thin")
    every = parse_duration(interval, "--interval")
    if follow and every < 1:  # 0s would re-read every log in a busy loop
        raise typer.BadParameter(f"{interval!r}: give at least 1s, e.g. 30s", param_hint="--interval")
    if metrics_port is not None and not 1 <= metrics_port <= 65535:
        raise typer.BadParameter(
            f"{metrics_port} is not a TCP port; give one from 1 to 65535, e.g. 9108",
            param_hint="--metrics-port",
        )
    options = MonitorOptions(
        window=spec,
        alpha=alpha,
        thin=thin if thin == "auto" else int(thin),
        logs=logs,
        rebuild_reference=rebuild_reference,
        dataset=dataset,
        split=split,
        reference_images=reference_images,
        precision=precision,
    )
    check_options(options)
    settings = load_settings()

    def progress(done: int, total: int) -> None:
        if not as_json and (done == total or done % 512 < 32):
            err.print(f"[dim]building the reference: {done}/{total} images[/]")

    reference, built = reference_for(model, options, settings, progress)
    name = f"{reference.model}/{reference.version}"
    if not as_json:
        what = "built" if built else "using"
        acc = "" if reference.accuracy is None else f", accuracy {reference.accuracy:.4f}"
        out.print(
            f"{what} the reference of {escape(name)}: {reference.images} images of "
            f"{escape(reference.dataset)} {escape(f'[{reference.split}]')}, "
            f"{reference.precision} export{acc}"
        )
    gauges = Gauges()
    if metrics_port is not None:
        gauges.serve(metrics_port)
        if not as_json:
            out.print(f"Prometheus metrics on http://127.0.0.1:{metrics_port}/metrics")
    while True:
        judged, stats, waiting = new_windows(reference, options, settings)
        for w in judged:
            gauges.publish(w)
            if as_json:
                out.print(json.dumps(w.to_json()), markup=False, highlight=False, soft_wrap=True)
            else:
                out.print(_line(w))
        if stats.bad and not as_json:
            err.print(
                f"[yellow]skipped {stats.bad} unreadable log lines[/] "
                f"(first: {escape(stats.first_error or '')})"
            )
        if not follow:
            if not judged and not as_json:
                out.print(
                    f"no complete window of {escape(name)} to judge yet ({waiting} requests in the "
                    "open one); see `visionloop serve`, or use --follow"
                )
            return
        time.sleep(every)


def _line(w: object) -> str:
    from visionloop.monitor.history import WindowRecord

    assert isinstance(w, WindowRecord)
    start = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(w.start))
    end = time.strftime("%H:%M:%S", time.localtime(w.end))
    acc = "" if w.estimated_accuracy is None else f"  est. accuracy {w.estimated_accuracy:.3f}"
    if w.status == "too_few_samples":
        verdict = "[dim]not tested (too few requests)[/]"
    elif w.drift:
        verdict = (
            f"[bold red]DRIFT[/] p={w.p_value:.2g}: {escape('; '.join(w.moved) or ', '.join(w.flagged))}"
        )
    else:
        verdict = f"[green]ok[/] p={w.p_value:.2g}"
    tests = " ".join(f"{k}={v:.2g}" for k, v in w.p_values.items() if v is not None)
    return (
        f"{start}-{end}  {w.requests} requests ({w.tested} tested)  {verdict}{acc}  [dim]{escape(tests)}[/]"
    )
