"""The end of a successful run: final weights, the model card, and their artifacts."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from visionloop.models import save_weights

if TYPE_CHECKING:
    from visionloop.train.loop import Loop
    from visionloop.train.setup import Components

log = logging.getLogger("visionloop.train")


def finalize(c: Components, loop: Loop, tracker: Any) -> dict[str, float]:
    """Write final.safetensors and model_card.json (atomically) and attach them to the run.
    Idempotent: a run killed halfway through this redoes it on resume."""
    rd = c.run_dir
    # Sharded (fsdp): the full state the loop gathered from every rank; the same file either way.
    save_weights(loop.final_state if loop.final_state is not None else loop.module, rd.final_weights)
    metrics = dict(loop.last_eval.metrics) if loop.last_eval else {}
    card = c.task.model_card(
        c.manifest, c.spec, mean=c.mean, std=c.std, metrics=metrics, run_uid=(rd.read_meta() or {}).get("uid")
    )
    card.save(rd.model_card)
    log.info("final weights %s, model card %s", rd.final_weights, rd.model_card)
    if tracker is not None:
        eval_dir = c.last_eval_dir or _latest_eval_dir(c)
        uploads = [(rd.final_weights, "model"), (rd.model_card, "model")]
        uploads += [(eval_dir, "eval")] if eval_dir is not None else []
        for path, where in uploads:
            try:
                tracker.log_artifact(path, artifact_path=where)
            except Exception as e:  # the files are safe in the run directory either way
                log.warning("could not attach %s to the MLflow run: %s", path, e)
    return metrics


def _latest_eval_dir(c: Components) -> Any:
    # After a resume that found training already complete, this process ran no evaluation;
    # the report of the last one is on disk.
    dirs = sorted(c.run_dir.eval_dir.glob("step-*")) if c.run_dir.eval_dir.is_dir() else []
    return dirs[-1] if dirs else None
