"""The end of a successful run: final weights, the model card, and their artifacts."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from visionloop.models import ModelCard, save_weights

if TYPE_CHECKING:
    from visionloop.train.loop import Loop
    from visionloop.train.setup import Components

log = logging.getLogger("visionloop.train")


def finalize(c: Components, loop: Loop, tracker: Any) -> dict[str, float]:
    """Write final.safetensors and model_card.json (atomically) and attach them to the run.
    Idempotent: a run killed halfway through this redoes it on resume."""
    spec, rd = c.spec, c.run_dir
    save_weights(loop.module, rd.final_weights)
    metrics = dict(loop.last_eval.metrics) if loop.last_eval else {}
    size = spec.data.image_size
    card = ModelCard.from_manifest(
        c.manifest,
        arch=spec.model.arch,
        model_kwargs=dict(spec.model.kwargs),
        input_size=(3, size, size),
        mean=c.mean,
        std=c.std,
        crop_pct=spec.data.crop_pct,
        # The trainer's eval transform resizes bilinearly whatever the architecture's
        # habit; the card must describe what the reported metrics were measured with.
        interpolation="bilinear",
        metrics={k: float(v) for k, v in metrics.items() if "/" not in k},
        run_uid=(rd.read_meta() or {}).get("uid"),
    )
    card.save(rd.model_card)
    log.info("final weights %s, model card %s", rd.final_weights, rd.model_card)
    if tracker is not None:
        tracker.log_artifact(rd.final_weights, artifact_path="model")
        tracker.log_artifact(rd.model_card, artifact_path="model")
        eval_dir = c.last_eval_dir or _latest_eval_dir(c)
        if eval_dir is not None:
            tracker.log_artifact(eval_dir, artifact_path="eval")
        tracker.flush()
    return metrics


def _latest_eval_dir(c: Components) -> Any:
    # After a resume that found training already complete, this process ran no evaluation;
    # the report of the last one is on disk.
    dirs = sorted(c.run_dir.eval_dir.glob("step-*")) if c.run_dir.eval_dir.is_dir() else []
    return dirs[-1] if dirs else None
