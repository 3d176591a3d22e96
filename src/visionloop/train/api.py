"""`train()`: one call that trains, or resumes, a run directory from a spec.

Exit semantics (also the CLI's exit code): 0 done, 75 stopped by a signal after writing a
checkpoint (rerun to resume), 76 paused at `until_epoch` after writing a checkpoint (rerun,
with a later or no `until_epoch`, to go on); errors raise.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from visionloop.core.errors import CheckpointError, TrainingError
from visionloop.core.settings import Settings, load_settings
from visionloop.specs import TrainSpec
from visionloop.train import dist
from visionloop.train import rng as rng_state
from visionloop.train.checkpoint import load_verified
from visionloop.train.checkpoint_store import CheckpointStore
from visionloop.train.device import configure_determinism, cpu_threads, resolve_device, resolve_precision
from visionloop.train.finalize import finalize
from visionloop.train.loop import Loop
from visionloop.train.report import Reporter, StartInfo, TrainResult
from visionloop.train.rundir import RESUMABLE_CHANGES, RunDir, spec_fingerprint
from visionloop.train.setup import Components, build
from visionloop.train.signals import EXIT_PAUSED, EXIT_PREEMPTED, StopRequest

log = logging.getLogger("visionloop.train")


def _attach_log_file(path: Path) -> logging.Handler:
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("visionloop")
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    return handler


def _detach_log_file(handler: logging.Handler) -> None:
    logging.getLogger("visionloop").removeHandler(handler)
    handler.close()


def train(
    spec: TrainSpec,
    run_dir: Path,
    *,
    spec_text: str | None = None,
    resolved: Mapping[str, Any] | None = None,
    settings: Settings | None = None,
    reporter: Reporter | None = None,
    track: bool = True,
    stop: StopRequest | None = None,
    until_epoch: int | None = None,
) -> TrainResult:
    """Train (or resume) `run_dir` from `spec`. Safe to call under torchrun.

    `until_epoch`: stop after that many epochs are done and evaluated, with a checkpoint
    (exit code 76), as a tuning trial does at a rung; the run goes on from there when called
    again with a later one (or none). The learning-rate schedule is always the whole run's,
    so a run paused and continued ends with the same weights as one never paused."""
    settings = settings or load_settings()
    reporter = reporter or Reporter()
    resolved = dict(resolved) if resolved is not None else spec.model_dump(mode="json")
    spec_text = spec_text if spec_text is not None else _dump(resolved)
    info = dist.from_env()
    device = resolve_device(spec.device, info)
    import torch

    # On the CPU, torch's threads take the cores the loader workers leave (see cpu_threads);
    # restored at the end, since a library caller's process goes on.
    threads = cpu_threads(spec.data.workers, info) if device.type == "cpu" else None
    restore_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    own_group = dist.init(info, device)
    # The CLI installs the handlers before its slow imports, so a SIGTERM during start-up is
    # also a clean, resumable stop; library callers get them installed here. Handlers the
    # caller installed stay: a stop signal that comes while the CLI's process winds down
    # (the scheduler's SIGTERM to a trial that has just paused at its rung) must find the
    # flag, not the default action, which would turn a saved run's exit 75/76 into 143.
    own_stop = stop is None
    stop = stop or StopRequest().install()
    rd = RunDir(run_dir)
    handler: logging.Handler | None = None
    loop: Loop | None = None
    tracker: Any = None
    try:
        meta: dict[str, Any] | None = None
        if info.is_main:
            rd.lock()
            meta, _ = rd.prepare(spec_text, resolved)
            rd.check_own_file(rd.log_file)
            rd.check_own_dirs()
            handler = _attach_log_file(rd.log_file)
        meta = dist.broadcast_object(meta, info)
        assert meta is not None
        if meta.get("status") == "succeeded" and rd.final_weights.is_file():
            return _already_finished(rd, meta)

        configure_determinism(spec.deterministic, device, compiled=spec.model.compile)
        rng_state.seed_everything(spec.seed)
        c = build(spec, info, device, rd, spec_fingerprint(resolved))
        if info.rank:
            rng_state.seed_everything(spec.seed + 7919 * info.rank)  # per-rank dropout streams
        precision = resolve_precision(spec.precision, device, spec.deterministic)
        loop = Loop(
            c,
            precision=precision,
            reporter=reporter,
            stop=stop,
            tracker=None,
            store=_checkpoint_store(settings, spec, rd, spec_fingerprint(resolved), info, reporter),
        )
        loop.until_epoch = until_epoch
        resumed_from = _resume(loop, info, reporter)

        if info.is_main and track and spec.tracking.enabled:
            tracker = _open_tracker(
                settings, spec, c, rd, meta, precision.name, resolved, lambda: loop.pos.step
            )
            loop.tracker = tracker
            rd.update_meta(mlflow_run_id=tracker.run_id, status="running")
        elif info.is_main:
            rd.update_meta(status="running")
        reporter.start(_start_info(c, rd, tracker, resumed_from, precision.name, device))
        log.info("training %s from step %d of %d", rd.path, loop.pos.step, c.total_steps)

        completed = loop.run()
        if not completed:
            # The run directory is the record a scheduler reads: it is written first, and the
            # tracking store (which may be unreachable) can never turn a clean stop into a failure.
            state = "paused" if loop.paused else "preempted"
            if info.is_main:
                rd.update_meta(status=state, step=loop.pos.step)
            _end_tracking(tracker, "KILLED", {"visionloop.state": state})
            result = _result(EXIT_PAUSED if loop.paused else EXIT_PREEMPTED, c, loop, rd, tracker)
            reporter.finish(result)
            return result

        final = finalize(c, loop, tracker) if info.is_main else {}
        if info.is_main:
            rd.update_meta(status="succeeded", step=loop.pos.step, final_metrics=final, finished=time.time())
        _end_tracking(tracker, "FINISHED", {"visionloop.state": "succeeded"})
        dist.barrier(info)
        result = _result(0, c, loop, rd, tracker)
        reporter.finish(result)
        return result
    except BaseException as e:
        # Only the process holding the lock may touch run.json: a second trainer refused the
        # lock must not mark the live run as failed; nor one whose folder or spec `prepare`
        # refused (a folder that is no run's must not get a run.json, which would let a
        # second try overwrite what is in it; a run refused another spec is not failed).
        if rd.locked and meta is not None:
            rd.update_meta(status="failed", error=str(e)[:2000])
        _end_tracking(tracker, "FAILED", {"visionloop.state": "failed", "visionloop.error": str(e)[:500]})
        raise
    finally:
        # Run from the bottom up (ExitStack), each one even if an earlier one raised (a failed
        # last checkpoint write makes loop.close raise): the process group is destroyed last,
        # after the pending checkpoint write is durable and the writer thread is joined, and
        # on every way out (a process that exits with its group alive can abort at exit).
        with contextlib.ExitStack() as cleanup:
            # Registered first, so it runs last: until the last checkpoint is durable
            # (loop.close), a SIGTERM is still a request, never the default kill.
            if own_stop:
                cleanup.callback(stop.uninstall)
            if own_group:
                cleanup.callback(dist.shutdown)
            cleanup.callback(rd.unlock)
            if handler is not None:
                cleanup.callback(_detach_log_file, handler)
            if loop is not None:
                cleanup.callback(loop.close)
            cleanup.callback(torch.set_num_threads, restore_threads)


def _end_tracking(tracker: Any, status: str, tags: Mapping[str, str]) -> None:
    """Tag and close the MLflow run, best effort: the training result is already on disk, and a
    tracking server that is down must neither fail the run nor hide the original error."""
    if tracker is None:
        return
    try:
        tracker.set_tags(dict(tags))
    except Exception as e:
        log.warning("could not tag the MLflow run %s as %s: %s", tracker.run_id, status, e)
    try:
        tracker.close(status=status)
    except Exception as e:
        log.warning("could not close the MLflow run %s: %s", tracker.run_id, e)


def _dump(doc: Mapping[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(dict(doc), sort_keys=False)


def _checkpoint_store(
    settings: Settings, spec: TrainSpec, rd: RunDir, fingerprint: str, info: dist.DistInfo, reporter: Reporter
) -> CheckpointStore | None:
    """The object store's copy of the run's checkpoints, when the settings name a store
    (checkpoint_store.py); the main process writes checkpoints, so only it copies them."""
    if not settings.checkpoint_store or not info.is_main:
        return None
    if spec.distributed == "fsdp":
        reporter.message(
            f"warning: sharded (fsdp) checkpoints are not copied to {settings.checkpoint_store}; "
            "they stay in the run directory only"
        )
        return None
    store = CheckpointStore.for_run(settings, rd.path, fingerprint)
    if store is not None:
        reporter.message(f"checkpoints are copied to {store.uri()}")
    return store


def _resume(loop: Loop, info: dist.DistInfo, reporter: Reporter) -> int | None:
    chosen: str | None = None
    state: dict[str, Any] | None = None
    if info.is_main:
        found = loop.ckpt.load_latest()
        if found is not None:
            chosen, state = str(found[0].path), found[1]
    chosen = dist.broadcast_object(chosen, info)
    if chosen is None:
        return None
    if state is None:
        state = load_verified(Path(chosen))
    try:
        loop.load_state_dict(state)
    except CheckpointError as e:
        # Verified, so not set aside: it may be another run's, or fine with the right spec.
        where = Path(chosen)
        raise CheckpointError(
            f"cannot resume from {where}: {e} To resume from the checkpoint before it instead, move "
            f"{where.name} out of {where.parent}."
        ) from e
    name = Path(chosen).name
    store = loop.ckpt.store
    came = f", downloaded from {store.uri()}" if store is not None and name in store.fetched else ""
    reporter.message(f"resuming from {name} (step {loop.pos.step}{came})")
    log.info("resumed from %s at step %d", chosen, loop.pos.step)
    return loop.pos.step


def _open_tracker(
    settings: Settings,
    spec: TrainSpec,
    c: Components,
    rd: RunDir,
    meta: Mapping[str, Any],
    precision: str,
    resolved: Mapping[str, Any],
    step_fn: Callable[[], int],
) -> Any:
    from visionloop.track import open_run

    tags = {
        "visionloop.uid": str(meta["uid"]),
        "visionloop.run_dir": str(rd.path),
        "visionloop.dataset_version": c.manifest.version,
        "visionloop.dataset_dir": str(spec.data.dataset),
        "visionloop.arch": spec.model.arch,
        "visionloop.task": spec.task,
        "visionloop.state": "running",
        # Tags, not params: a resumed run may legitimately land on other hardware (spot).
        "visionloop.world_size": str(c.dist.world_size),
        "visionloop.device_type": c.device.type,
        "visionloop.precision": precision,
    }
    tracker = open_run(
        settings,
        uid=str(meta["uid"]),
        experiment=spec.tracking.experiment or settings.experiment,
        run_name=spec.tracking.run_name or rd.path.name,
        run_dir=rd.path,
        tags=tags,
        code_dir=Path.cwd(),
        parent_run_id=spec.tracking.parent_run_id,
        spec_tags=spec.tracking.tags,
    )
    # Fields that may change when a run is resumed (workers, device, checkpoint cadence) are
    # tags: MLflow params are write-once, and a resume on other hardware must not fail.
    from visionloop.track import flatten_params

    flat = flatten_params(dict(resolved))
    tracker.log_params({k: v for k, v in flat.items() if k not in RESUMABLE_CHANGES})
    tracker.set_tags({f"visionloop.spec.{k}": v for k, v in flat.items() if k in RESUMABLE_CHANGES})
    tracker.log_params(
        {
            "derived.num_params": c.num_params,
            "derived.steps_per_epoch": c.steps_per_epoch,
            "derived.total_steps": c.total_steps,
            "derived.train_images": len(c.train_reader) - len(c.held_out),
            "derived.eval_split": c.eval_split or "none",
        }
    )
    spec_file = rd.path / "spec.yaml"
    if spec_file.is_file():
        tracker.log_artifact(spec_file, artifact_path="spec")
        tracker.log_artifact(rd.path / "spec.resolved.yaml", artifact_path="spec")
    tracker.start_system_metrics(step_fn=step_fn, every_s=spec.tracking.system_metrics_every_s)
    return tracker


def _start_info(
    c: Components, rd: RunDir, tracker: Any, resumed_from: int | None, precision: str, device: Any
) -> StartInfo:
    return StartInfo(
        run_dir=rd.path,
        run_id=tracker.run_id if tracker is not None else None,
        resumed_from_step=resumed_from,
        total_steps=c.total_steps,
        steps_per_epoch=c.steps_per_epoch,
        epochs=c.epochs,
        device=str(device),
        precision=precision,
        world_size=c.dist.world_size,
        num_params=c.num_params,
        train_images=len(c.train_reader) - len(c.held_out),
        val_images=c.eval_size,
        dataset_version=c.manifest.version,
    )


def _result(code: int, c: Components, loop: Loop, rd: RunDir, tracker: Any) -> TrainResult:
    train_s = loop.pos.train_time_s
    return TrainResult(
        exit_code=code,
        run_dir=rd.path,
        step=loop.pos.step,
        total_steps=c.total_steps,
        run_id=tracker.run_id if tracker is not None else None,
        final_metrics=dict(loop.last_eval.metrics) if loop.last_eval else {},
        best_metric=loop.pos.best_metric,
        checkpoints=[i.path for i in loop.ckpt.infos()],
        final_weights=rd.final_weights if rd.final_weights.is_file() else None,
        model_card=rd.model_card if rd.model_card.is_file() else None,
        train_seconds=train_s,
        images_per_s=loop.pos.images_seen / train_s if train_s else 0.0,
        ui_command=tracker.ui_command() if tracker is not None else None,
    )


def _already_finished(rd: RunDir, meta: Mapping[str, Any]) -> TrainResult:
    raise_if = meta.get("step")
    if raise_if is None:
        raise TrainingError(
            f"{rd.meta_file} says the run succeeded but records no step; the file is damaged."
        )
    return TrainResult(
        exit_code=0,
        run_dir=rd.path,
        step=int(meta["step"]),
        total_steps=int(meta["step"]),
        run_id=meta.get("mlflow_run_id"),
        final_metrics=dict(meta.get("final_metrics") or {}),
        final_weights=rd.final_weights,
        model_card=rd.model_card if rd.model_card.is_file() else None,
        already_finished=True,
    )
