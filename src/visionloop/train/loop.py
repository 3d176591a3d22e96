"""The training loop: task-agnostic, resumable at any step, exact on CPU.

Position in training is four numbers — epoch, batch within the epoch, global step and
whether the epoch's evaluation is still owed — and everything random is either restored from
the checkpoint (torch/python/numpy RNG, per rank) or derived from (seed, epoch, sample).
That is why a run killed at any moment and resumed ends bitwise identical to one that never
stopped (CPU, deterministic mode).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from visionloop.core.errors import CheckpointError, TrainingError
from visionloop.data.loader import make_loader
from visionloop.data.normalize import Normalizer
from visionloop.data.sampler import EvalBatchSampler, ResumableBatchSampler
from visionloop.tasks import EvalResult
from visionloop.train import dist, progress, sharding
from visionloop.train import rng as rng_state
from visionloop.train.checkpoint import CheckpointManager
from visionloop.train.checkpoint_store import CheckpointStore
from visionloop.train.device import Precision
from visionloop.train.evaluation import eval_rounds, score_split
from visionloop.train.report import Reporter
from visionloop.train.setup import Components
from visionloop.train.sharded_checkpoint import ShardedCheckpointManager
from visionloop.train.signals import StopRequest

log = logging.getLogger("visionloop.train")


@dataclass
class Position:
    epoch: int = 0
    batch: int = 0  # next batch to train within `epoch`
    step: int = 0  # optimizer steps taken
    pending_eval: bool = False
    evals_done: int = 0
    best_metric: float | None = None
    train_time_s: float = 0.0
    images_seen: int = 0


_COUNTS = ("epoch", "batch", "step", "evals_done", "images_seen")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class Loop:
    """Runs steps and evaluations from a Position until done or asked to stop."""

    def __init__(
        self,
        c: Components,
        *,
        precision: Precision,
        reporter: Reporter,
        stop: StopRequest,
        tracker: Any | None,
        store: CheckpointStore | None = None,
    ) -> None:
        self.c = c
        self.spec = c.spec
        self.precision = precision
        self.reporter = reporter
        self.stop = stop
        self.tracker = tracker
        self.info = c.dist
        self.device = c.device
        self.pos = Position()
        self.last_eval: EvalResult | None = None
        self.normalize = Normalizer(c.mean, c.std)
        # Unset in the spec: the task's primary metric decides "best" (val/accuracy, val/mAP).
        self.best_metric = self.spec.checkpoint.best_metric or f"val/{c.task.primary_metric}"
        self.best_mode = self.spec.checkpoint.best_mode or c.task.primary_mode
        # `distributed: fsdp`: sharded parameters, sharded checkpoints (see sharding.py). Also
        # with one process, which shards nothing but keeps the checkpoint format.
        self.sharded = self.spec.distributed == "fsdp"
        self.ckpt: CheckpointManager | ShardedCheckpointManager
        if self.sharded:
            self.scaler = sharding.grad_scaler(self.device, enabled=precision.needs_scaler)
            self.ckpt = ShardedCheckpointManager(
                c.run_dir.checkpoints,
                keep_last=self.spec.checkpoint.keep_last,
                keep_best=self.spec.checkpoint.keep_best,
                best_mode=self.best_mode,
                info=self.info,
            )
        else:
            self.scaler = torch.amp.GradScaler(self.device.type, enabled=precision.needs_scaler)
            self.ckpt = CheckpointManager(
                c.run_dir.checkpoints,
                keep_last=self.spec.checkpoint.keep_last,
                keep_best=self.spec.checkpoint.keep_best,
                best_mode=self.best_mode,
                store=store,
            )
        self.final_state: dict[str, torch.Tensor] | None = None  # set by run() when training completes
        self.sampler = ResumableBatchSampler(
            c.train_reader.chunk_sizes,
            self.spec.data.batch_size,
            seed=self.spec.seed,
            rank=self.info.rank,
            world_size=self.info.world_size,
            window=self.spec.data.shuffle_window,
            exclude=c.held_out,
        )
        pin = self.device.type == "cuda"
        self.train_loader = make_loader(
            c.train_dataset,
            self.sampler,
            workers=self.spec.data.workers,
            pin_memory=pin,
            seed=self.spec.seed,
            collate_fn=c.task.collate,
        )
        self.eval_loader = None
        if c.eval_dataset is not None:
            eval_bs = self.spec.data.eval_batch_size or max(
                self.spec.data.batch_size // self.info.world_size, 1
            )
            eval_sampler = EvalBatchSampler(
                c.eval_size, eval_bs, rank=self.info.rank, world_size=self.info.world_size
            )
            self.eval_loader = make_loader(
                c.eval_dataset,
                eval_sampler,
                workers=self.spec.data.workers,
                pin_memory=pin,
                seed=self.spec.seed,
                collate_fn=c.task.collate,
            )
        self._last_ckpt_time = time.monotonic()
        self.pace = progress.Pace()  # how far and how fast, for the control plane's expected end
        self._saved_step: int | None = None  # the step of the newest checkpoint this run holds
        # Pause (checkpointed, exit 76) once this many epochs are done and evaluated: a tuning
        # trial stops at its rung and waits to be promoted (see train/signals.py EXIT_PAUSED).
        self.until_epoch: int | None = None
        self.paused = False
        self._warned_metric = False

    def close(self) -> None:
        """Stop the loader workers and wait for the last checkpoint write.

        Must be called: workers ignore SIGTERM (see data/loader.py), so multiprocessing's
        exit-time terminate() would not end them and the process would hang on exit."""
        try:
            self.ckpt.close()
        finally:
            for loader in (self.train_loader, self.eval_loader):
                it = getattr(loader, "_iterator", None)
                if it is not None and hasattr(it, "_shutdown_workers"):
                    it._shutdown_workers()
                    loader._iterator = None  # type: ignore[union-attr]

    # ------------------------------------------------------------------ state
    @property
    def module(self) -> nn.Module:
        # torch.compile wraps DDP (which wraps the model): unwrap in that order, so the
        # state dict has the model's own keys, without "_orig_mod." or "module.".
        m = getattr(self.c.model, "_orig_mod", self.c.model)
        return m.module if isinstance(m, DistributedDataParallel) else m

    def state_dict(self) -> dict[str, Any]:
        ranks_rng = dist.gather_objects(rng_state.capture(cuda=self.device.type == "cuda"), self.info)
        if self.sharded:
            # This rank's shards, by parameter name (the optimizer's None before its first step).
            model_state, optim_state = sharding.sharded_state(self.module, self.c.optimizer)
        else:
            model_state, optim_state = self.module.state_dict(), self.c.optimizer.state_dict()
        return {
            "format": 1,
            "position": asdict(self.pos),
            "model": model_state,
            "optimizer": optim_state,
            "scheduler": self.c.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
            "rng": ranks_rng,
            "world_size": self.info.world_size,
            "last_eval": self.last_eval.metrics if self.last_eval else None,
            "spec_sha256": self.c.spec_sha256,
            "dataset_version": self.c.manifest.version,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("spec_sha256") != self.c.spec_sha256:
            raise CheckpointError(
                "this checkpoint was written by a run with a different spec (its spec hash differs), so "
                "resuming from it would not continue that run. Restore the run's own spec.yaml, or train "
                "into a new --run-dir (copying checkpoints between runs is not supported)."
            )
        if state.get("dataset_version") != self.c.manifest.version:
            raise TrainingError(
                f"the checkpoint was trained on dataset version {state.get('dataset_version')}, but "
                f"{self.spec.data.dataset} is now version {self.c.manifest.version}. Point "
                f"data.dataset at the original dataset, or start a new run directory."
            )
        if "dcp_dir" in state and not self.sharded:
            raise CheckpointError(
                f"{state['dcp_dir']} is a sharded (distributed: fsdp) checkpoint, and this run uses "
                f"distributed: {self.spec.distributed}. Set distributed: fsdp to resume it."
            )
        try:
            if self.sharded:
                if "dcp_dir" not in state:
                    raise CheckpointError(
                        "this run uses distributed: fsdp, but its checkpoint is a single file (a ddp "
                        "run's). Set distributed: ddp to resume it, or train into a new --run-dir."
                    )
                sharding.load_sharded(
                    self.module,
                    self.c.optimizer,
                    Path(state["dcp_dir"]),
                    with_optimizer=bool(state.get("has_optimizer_state")),
                )
            else:
                self.module.load_state_dict(state["model"])
                self.c.optimizer.load_state_dict(state["optimizer"])
            self.c.scheduler.load_state_dict(state["scheduler"])
            if state["scaler"] and self.scaler.is_enabled():
                self.scaler.load_state_dict(state["scaler"])
            pos = Position(**state["position"])
        except (RuntimeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"the checkpoint does not fit this run's model or optimizer ({str(e)[:300]}). It was "
                f"written by another version of visionloop or another spec; train into a new --run-dir."
            ) from e
        self._check_position(pos)
        if not self.sharded:
            self._check_weights_finite(state["model"])
        self.pos = pos
        self._saved_step = self.pos.step
        if state.get("last_eval"):
            self.last_eval = EvalResult(metrics=dict(state["last_eval"]))
        # RNG last: building the model and loaders above may have drawn from it.
        ranks_rng = state["rng"]
        if len(ranks_rng) == self.info.world_size:
            rng_state.restore(ranks_rng[self.info.rank])
        else:
            log.warning(
                "checkpoint was written by %d process(es), now %d: RNG streams are re-seeded, so this "
                "resumption is not bitwise reproducible",
                len(ranks_rng),
                self.info.world_size,
            )
            rng_state.seed_everything(self.spec.seed + 1_000_003 * self.pos.step + self.info.rank)

    def _check_position(self, pos: Position) -> None:
        """A position this run can be at: the checkpoint's own spec hash matched, so anything
        else (a step past the run's end, a negative count) is damage, not another run's."""
        fields: dict[str, Any] = asdict(pos)
        problem = next((f"{k} is {fields[k]!r:.40}" for k in _COUNTS if not _is_count(fields[k])), None)
        best, spent = fields["best_metric"], fields["train_time_s"]
        if problem is not None:
            pass
        elif pos.step > self.c.total_steps:
            problem = f"its step {pos.step} is past this run's last, {self.c.total_steps}"
        elif pos.batch >= self.sampler.steps_per_epoch:
            problem = f"its batch {pos.batch} is past an epoch of {self.sampler.steps_per_epoch}"
        elif not isinstance(fields["pending_eval"], bool):
            problem = f"pending_eval is {fields['pending_eval']!r:.40}"
        elif best is not None and not (isinstance(best, int | float) and not isinstance(best, bool)):
            problem = f"best_metric is {best!r:.40}"
        elif not (isinstance(spent, int | float) and math.isfinite(spent)):
            problem = f"train_time_s is {spent!r:.40}"
        if problem is not None:
            raise CheckpointError(
                f"the checkpoint's training position is impossible ({problem}); it is damaged."
            )

    def _check_weights_finite(self, model_state: Any) -> None:
        """NaN or infinite weights cannot come from a run that checks its loss: damage (or a
        tampered file), which training on would only spread to the final weights."""
        for name, value in model_state.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not value.isfinite().all():
                raise CheckpointError(
                    f"the checkpoint's weight {name} holds NaN or infinite values; it is damaged."
                )

    def save_checkpoint(self, metric: float | None = None, *, block: bool = False) -> None:
        state = self.state_dict()
        if self.sharded or self.info.is_main:  # sharded: every rank writes its own shards
            self.ckpt.save(state, self.pos.step, metric, block=block, before_commit=self._flush_metrics)
        if self.info.is_main:
            self.reporter.checkpoint(self.pos.step, self.ckpt.last_stall_s)
            log.info("checkpoint at step %d (loop blocked %.3f s)", self.pos.step, self.ckpt.last_stall_s)
        self._last_ckpt_time = time.monotonic()
        self._saved_step = self.pos.step
        if block:
            dist.barrier(self.info)

    def _flush_metrics(self) -> None:
        """Runs on the checkpoint writer just before the checkpoint becomes visible: a resumed
        run replays only the steps after its checkpoint, so every step logged before it must be
        in the store by then. If the store is down, the checkpoint still lands (with a gap)."""
        if self.tracker is not None and not self.tracker.flush(timeout=60.0):
            log.warning(
                "metrics were not all stored before checkpoint %d; a crash now leaves a gap", self.pos.step
            )

    # ------------------------------------------------------------------ main
    @property
    def done(self) -> bool:
        return self.pos.step >= self.c.total_steps and not self.pos.pending_eval

    def run(self) -> bool:
        """Train until done (True) or until a stop was requested and checkpointed (False)."""
        try:
            return self._run()
        except torch.OutOfMemoryError as e:
            raise TrainingError(
                f"out of memory on {self.device} at step {self.pos.step}: lower data.batch_size or "
                f"data.eval_batch_size, or use precision: bf16. The last checkpoint is kept; since these "
                f"fields change the run, train into a new --run-dir."
            ) from e

    def _run(self) -> bool:
        if dist.any_flag([self.stop.requested], self.device, self.info)[0]:
            return self._stop_now()  # stopped while starting up
        while not self.done:
            if self.pos.pending_eval:
                if not self._evaluate():
                    return self._stop_now()
                continue
            if self.until_epoch is not None and self.pos.batch == 0 and self.pos.epoch >= self.until_epoch:
                self.paused = True
                return self._stop_now(f"paused after epoch {self.pos.epoch}")
            if not self._train_epoch():
                return self._stop_now()
        self.ckpt.wait()
        # The weights final.safetensors gets, on rank 0; gathering FSDP's shards is collective,
        # so every rank takes part here (only rank 0 finalizes).
        self.final_state = sharding.full_state_dict(self.module, self.info) if self.sharded else None
        return True

    def _stop_now(self, why: str | None = None) -> bool:
        why = why or str(self.stop.signal_name)
        log.info("stopping (%s): checkpointing at step %d", why, self.pos.step)
        if self._saved_step == self.pos.step:
            # Nothing happened since the last checkpoint (a stop during start-up, or one that
            # coincides with a periodic save): make that one durable rather than write it again,
            # which would also drop its "best" score.
            self.reporter.message(f"stopping ({why}): checkpoint at step {self.pos.step} kept")
            if self.info.is_main:
                self.ckpt.wait()
            dist.barrier(self.info)
            return False
        self.reporter.message(f"stopping ({why}): writing a checkpoint at step {self.pos.step}")
        self.save_checkpoint(block=True)
        return False

    def _should_stop_or_checkpoint(self) -> tuple[bool, bool]:
        cp = self.spec.checkpoint
        due = bool(cp.every_steps and self.pos.step % cp.every_steps == 0)
        if cp.every_minutes and time.monotonic() - self._last_ckpt_time >= cp.every_minutes * 60:
            due = True
        # Every rank must agree, or one would wait forever in a collective the others skip.
        stop, due = dist.any_flag([self.stop.requested, due], self.device, self.info)
        return stop, due

    def _train_epoch(self) -> bool:
        c, pos = self.c, self.pos
        steps_per_epoch = self.sampler.steps_per_epoch
        last = min(steps_per_epoch, pos.batch + (c.total_steps - pos.step))
        self.sampler.set_position(pos.epoch, pos.batch)
        self.c.model.train()
        self.reporter.epoch_start(pos.epoch, pos.step + 1, pos.step + (last - pos.batch))
        log_every = self.spec.tracking.log_every_steps
        losses: list[torch.Tensor] = []
        lrs: list[float] = []
        t_interval = time.perf_counter()
        t_epoch = t_interval
        images_interval = 0
        stop = False
        for x, y in self.train_loader:
            lrs.append(float(self.c.scheduler.get_last_lr()[0]))
            losses.append(self._step(x, y))
            pos.batch += 1
            pos.step += 1
            pos.images_seen += self.spec.data.batch_size
            images_interval += self.spec.data.batch_size
            end_of_epoch = pos.batch >= steps_per_epoch
            finished = pos.step >= c.total_steps
            if end_of_epoch or finished:
                pos.epoch, pos.batch = (pos.epoch + 1, 0) if end_of_epoch else (pos.epoch, pos.batch)
                every = self.spec.eval.every_epochs
                pos.pending_eval = finished or (end_of_epoch and pos.epoch % every == 0)
            if len(losses) >= log_every or end_of_epoch or finished:
                now = time.perf_counter()
                self._log_steps(losses, lrs, images_interval / max(now - t_interval, 1e-9))
                losses, lrs, images_interval, t_interval = [], [], 0, now
            if self.info.is_main:
                self.pace.tick(pos.step, c.total_steps)
            stop, due = self._should_stop_or_checkpoint()
            if due and not pos.pending_eval:  # the post-eval checkpoint covers the epoch boundary
                if losses:
                    # A resumed run replays only the steps after this checkpoint: the steps of
                    # the open logging interval must be logged (and flushed) before it commits.
                    now = time.perf_counter()
                    self._log_steps(losses, lrs, images_interval / max(now - t_interval, 1e-9))
                    losses, lrs, images_interval, t_interval = [], [], 0, now
                self.save_checkpoint()
            if stop or end_of_epoch or finished:
                break
        pos.train_time_s += time.perf_counter() - t_epoch
        if losses:
            self._log_steps(losses, lrs, None)
        return not stop

    def _step(self, x: torch.Tensor, y: Any) -> torch.Tensor:
        c = self.c
        x = self.normalize(x.to(self.device, non_blocking=True), self.spec.model.channels_last)
        y = c.task.targets_to(y, self.device)
        with self.precision.autocast(self.device):
            loss = c.task.train_loss(c.model, x, y, c.loss_fn)
        c.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        if self.spec.optimizer.grad_clip_norm:
            self.scaler.unscale_(c.optimizer)
            nn.utils.clip_grad_norm_(c.model.parameters(), self.spec.optimizer.grad_clip_norm)
        self.scaler.step(c.optimizer)
        self.scaler.update()
        c.scheduler.step()
        if self.sharded:
            sharding.sync_buffers(self.module, self.info)  # DDP's buffer semantics (see sharding.py)
        return loss.detach()

    def _log_steps(self, losses: list[torch.Tensor], lrs: list[float], images_per_s: float | None) -> None:
        # One device→host sync per logging interval, not per step.
        values = torch.stack(losses).float()
        if self.info.enabled:
            values = dist.all_reduce_sum(values, self.info) / self.info.world_size
        host = values.tolist()
        first = self.pos.step - len(host) + 1
        if not self.precision.needs_scaler and not all(math.isfinite(v) for v in host):
            raise TrainingError(
                f"the training loss became {host[-1]} around step {self.pos.step}. Lower optimizer.lr, "
                f"add schedule.warmup_epochs or set optimizer.grad_clip_norm, and train into a new "
                f"--run-dir (a run directory keeps the spec it was started with)."
            )
        if self.info.is_main:
            for i, (loss, lr) in enumerate(zip(host, lrs, strict=True)):
                metrics = {"train/loss": loss, "train/lr": lr}
                if images_per_s is not None:
                    metrics["train/images_per_s"] = images_per_s
                if self.tracker is not None:
                    self.tracker.log_metrics(metrics, step=first + i)
            self.reporter.step(self.pos.step, host[-1], lrs[-1], images_per_s)

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self) -> bool:
        """Evaluate the held-out split; False if stopped midway (the eval is redone on resume)."""
        pos = self.pos
        if self.eval_loader is None:
            # No held-out split: nothing to measure, but this is still the epoch boundary (or
            # the end) whose checkpoint the training loop left to the evaluation.
            pos.pending_eval = False
            self.save_checkpoint()
            return True
        # Under DDP, evaluate the wrapped module itself: a DDP forward can broadcast buffers (a
        # collective), and a rank with fewer eval batches would then skip it and hang the rest.
        model = self.module if self.info.enabled else self.c.model
        # Ranks hold different numbers of eval batches (strided split); every rank runs the
        # same number of stop checks so that the collectives stay matched.
        batch_size = int(self.eval_loader.batch_sampler.batch_size)  # type: ignore[union-attr]
        rounds = eval_rounds(self.c.eval_size, batch_size, self.info.world_size)
        self.reporter.eval_start(pos.epoch, rounds)
        # FSDP: parameters gathered for the whole pass, so that ranks with fewer eval batches
        # (fewer forwards) do not leave the others waiting in an all-gather.
        with sharding.unsharded(model) if self.sharded else contextlib.nullcontext():
            scored = score_split(
                task=self.c.task,
                classes=self.c.manifest.classes,
                model=model,
                batches=self.eval_loader,
                rounds=rounds,
                normalize=self.normalize,
                channels_last=self.spec.model.channels_last,
                precision=self.precision,
                device=self.device,
                info=self.info,
                stop=self.stop,
                reporter=self.reporter,
                loss_fn=self.c.loss_fn,
            )
        if scored is None:
            return False
        evaluator, result = scored
        self.last_eval = result
        pos.pending_eval = False
        pos.evals_done += 1
        metric_name = self.best_metric.removeprefix("val/")
        metric = result.metrics.get(metric_name)
        if metric is None and not self._warned_metric:
            self._warned_metric = True
            names = ", ".join(f"val/{k}" for k in result.metrics if "/" not in k)
            text = f"checkpoint.best_metric {self.best_metric!r} is not measured ({names})"
            log.warning("%s; no checkpoint is kept as best", text)
            self.reporter.message(text + "; no checkpoint is kept as best")
        if metric is not None and self._is_better(metric):
            pos.best_metric = metric
        if self.info.is_main:
            if self.tracker is not None:
                self.tracker.log_metrics({f"val/{k}": v for k, v in result.metrics.items()}, step=pos.step)
                self.tracker.log_metrics({"epoch": float(pos.epoch)}, step=pos.step)
            out_dir = self.c.run_dir.eval_dir / f"step-{pos.step:09d}"
            if self.c.run_dir.taken_by_other(out_dir):
                # Something put there by hand: the evaluation is done, but has nowhere to go.
                raise TrainingError(
                    f"{out_dir} is not a folder, so this evaluation's report cannot be written there. "
                    "Remove it, then rerun: the run resumes from its latest checkpoint."
                )
            out_dir.mkdir(parents=True, exist_ok=True)
            from visionloop.core.fsutil import atomic_write_json

            atomic_write_json(
                out_dir / "report.json", {"step": pos.step, "epoch": pos.epoch, **result.report}
            )
            if pos.step >= self.c.total_steps:
                # The plots of the final evaluation only: they are what the run's artifacts
                # and its model card show, and drawing them (matplotlib) at every evaluation
                # cost more CPU than a small model's whole evaluation. report.json above has
                # every evaluation's numbers.
                evaluator.write_artifacts(result, out_dir)
            self.c.last_eval_dir = out_dir
            epochs_done = pos.epoch + pos.batch / self.sampler.steps_per_epoch
            self.reporter.eval_end(epochs_done, pos.step, result.metrics, result.summary)
            progress.evaluation(pos.step, epochs_done, result.metrics)
            log.info("eval at step %d (epoch %d): %s", pos.step, pos.epoch, result.summary)
        self.save_checkpoint(metric)
        self.c.model.train()
        return True

    def _is_better(self, metric: float) -> bool:
        best = self.pos.best_metric
        if best is None:
            return True
        return metric > best if self.best_mode == "max" else metric < best
