"""The trainer as a library call (`visionloop.train.api.train`): precisions, time-based
checkpoints, pretrained weights, stopping through the API, and what gets tracked."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _trainkit import spec_doc
from visionloop.models import save_weights
from visionloop.specs import validate_train_spec
from visionloop.train.api import train
from visionloop.train.checkpoint import CheckpointManager
from visionloop.train.report import Reporter
from visionloop.train.signals import StopRequest


class Recorder(Reporter):
    def __init__(self) -> None:
        self.steps: list[tuple[int, float | None]] = []
        self.evals: list[tuple[float, int, dict[str, float]]] = []
        self.checkpoints: list[int] = []

    def step(self, step: int, loss: float | None, lr: float, images_per_s: float | None) -> None:
        self.steps.append((step, loss))

    def eval_end(self, epoch: float, step: int, metrics: dict[str, float], summary: str) -> None:
        self.evals.append((epoch, step, metrics))

    def checkpoint(self, step: int, stall_s: float) -> None:
        self.checkpoints.append(step)


class ForwardSpy:
    """Wraps the model factory (which the task's `build_model` calls): every forward of the
    model records the CPU autocast state it ran under and the dtype of the logits it returned."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import visionloop.models as models

        self.calls: list[tuple[bool, bool, torch.dtype, torch.dtype]] = []
        real = models.create_model

        def create(*args: object, **kwargs: object) -> torch.nn.Module:
            model = real(*args, **kwargs)  # type: ignore[arg-type]
            model.register_forward_hook(self._record)
            return model

        monkeypatch.setattr(models, "create_model", create)

    def _record(self, _module: torch.nn.Module, _inputs: object, out: torch.Tensor) -> None:
        self.calls.append(
            (
                torch.is_grad_enabled(),
                torch.is_autocast_enabled("cpu"),
                torch.get_autocast_dtype("cpu"),
                out.dtype,
            )
        )


# What each requested precision must become on CPU (deterministic: false): the autocast
# state of every forward, the logits' dtype, the recorded name, and whether a grad scaler runs.
PRECISIONS = {
    "fp32": (False, torch.float32, "fp32", False),
    "bf16": (True, torch.bfloat16, "bf16", False),
    "fp16": (True, torch.float16, "fp16", True),  # CPU fp16 autocast, with a grad scaler
    "auto": (False, torch.float32, "fp32", False),  # auto is fp32 on CPU
}


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_each_precision_trains_under_its_autocast_and_is_recorded(
    tmp_path: Path,
    digits_dataset: Path,
    precision: str,
    monkeypatch: pytest.MonkeyPatch,
    vl_home: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from mlflow.tracking import MlflowClient

    from _mlflowkit import copy_migrated_store
    from visionloop.core.settings import load_settings
    from visionloop.train.report import StartInfo

    autocast_on, logits_dtype, name, scaled = PRECISIONS[precision]
    copy_migrated_store(tmp_path_factory, vl_home)
    spy = ForwardSpy(monkeypatch)
    doc = spec_doc(
        digits_dataset, epochs=None, steps=4, precision=precision, deterministic=False, data__workers=0
    )

    class Started(Recorder):
        info: StartInfo | None = None

        def start(self, info: StartInfo) -> None:
            self.info = info

    rec = Started()
    result = train(validate_train_spec(doc), tmp_path / "run", reporter=rec)
    assert result.exit_code == 0 and result.step == 4
    assert [s for s, _ in rec.steps] == [1, 2, 3, 4]
    assert all(loss is not None and math.isfinite(loss) for _, loss in rec.steps)
    # The precision actually used: 4 training forwards, then the evaluation's (no grad), all
    # under the expected autocast. (The input-size probe before training runs outside it.)
    last_train = max(i for i, c in enumerate(spy.calls) if c[0])
    training = [c for c in spy.calls if c[0]]
    evaluation = spy.calls[last_train + 1 :]
    assert len(training) == 4 and evaluation and not any(c[0] for c in evaluation)
    for _, enabled, dtype, out_dtype in training + evaluation:
        assert enabled is autocast_on and out_dtype == logits_dtype
        if autocast_on:
            assert dtype == logits_dtype
    # ... and what the run records: the resolved name (the spec's request stays a param).
    assert rec.info is not None and rec.info.precision == name
    run = MlflowClient(load_settings().tracking_uri).get_run(str(result.run_id))
    assert run.data.tags["visionloop.precision"] == name
    assert run.data.params["precision"] == precision
    # A grad scaler runs (and is checkpointed) for fp16 only.
    found = CheckpointManager(tmp_path / "run" / "checkpoints", keep_last=2, keep_best=0).load_latest()
    assert found is not None
    scaler = found[1]["scaler"]
    assert (scaler != {}) is scaled
    if scaled:
        assert scaler["scale"] > 0
    final = load_file(str(tmp_path / "run" / "final.safetensors"))
    assert all(t.dtype == torch.float32 for k, t in final.items() if t.is_floating_point())
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["status"] == "succeeded"


def test_fp16_on_cpu_is_refused_in_deterministic_mode(tmp_path: Path, digits_dataset: Path) -> None:
    from visionloop.core.errors import TrainingError

    doc = spec_doc(digits_dataset, epochs=None, steps=1, precision="fp16", data__workers=0)
    with pytest.raises(TrainingError, match="fp16 on CPU is not supported with deterministic: true"):
        train(validate_train_spec(doc), tmp_path / "run", track=False)


def test_time_based_checkpoints_and_retention(tmp_path: Path, digits_dataset: Path) -> None:
    doc = spec_doc(
        digits_dataset,
        epochs=None,
        steps=12,
        data__workers=0,
        checkpoint={"every_steps": None, "every_minutes": 1e-6, "keep_last": 2, "keep_best": 0},
    )
    rec = Recorder()
    train(validate_train_spec(doc), tmp_path / "run", reporter=rec, track=False)
    # Every step is past the (tiny) interval, so every step but the last checkpoints, and the
    # post-eval checkpoint covers the last.
    assert rec.checkpoints == list(range(1, 13))
    kept = CheckpointManager(tmp_path / "run" / "checkpoints", keep_last=2, keep_best=0).infos()
    assert [c.step for c in kept] == [11, 12]


def test_stop_through_the_api_returns_75_and_a_rerun_finishes(tmp_path: Path, digits_dataset: Path) -> None:
    doc = spec_doc(digits_dataset, epochs=None, steps=10, data__workers=0)
    spec = validate_train_spec(doc)

    class StopAfter3(Recorder):
        def __init__(self, stop: StopRequest) -> None:
            super().__init__()
            self.stop = stop

        def step(self, step: int, loss: float | None, lr: float, images_per_s: float | None) -> None:
            super().step(step, loss, lr, images_per_s)
            if step == 3:
                self.stop.request("test")

    stop = StopRequest()
    first = train(spec, tmp_path / "run", reporter=StopAfter3(stop), track=False, stop=stop)
    assert first.exit_code == 75 and first.step == 3
    rec = Recorder()
    second = train(spec, tmp_path / "run", reporter=rec, track=False)
    assert second.exit_code == 0 and second.step == 10
    assert [s for s, _ in rec.steps] == list(range(4, 11))


def test_pretrained_weights_from_a_local_file_are_loaded(tmp_path: Path, digits_dataset: Path) -> None:
    from visionloop.models import create_model

    donor = create_model("small_cnn", 1000)  # a different head: it is skipped, the rest loads
    conv = donor.get_submodule("features.0.0")
    assert isinstance(conv, torch.nn.Conv2d)
    torch.nn.init.constant_(conv.weight, 0.125)
    weights = save_weights(donor, tmp_path / "donor.safetensors")
    doc = spec_doc(
        digits_dataset,
        epochs=None,
        steps=1,
        data__workers=0,
        model={"arch": "small_cnn", "pretrained": str(weights)},
        optimizer={"name": "sgd", "lr": 1e-12, "momentum": 0.0},
    )
    train(validate_train_spec(doc), tmp_path / "run", track=False)
    final = load_file(str(tmp_path / "run" / "final.safetensors"))
    first_conv = next(k for k in final if k.startswith("features.0.0.weight"))
    assert torch.allclose(final[first_conv], torch.full_like(final[first_conv], 0.125), atol=1e-6)
    card = json.loads((tmp_path / "run" / "model_card.json").read_text())
    assert card["mean"] == [0.485, 0.456, 0.406]  # normalize: auto → ImageNet stats with pretrained weights


def test_tracking_disabled_in_the_spec_leaves_mlflow_untouched(
    tmp_path: Path, vl_home: Path, digits_dataset: Path
) -> None:
    """`tracking.enabled: false` (a queue job's or a study's --no-track): the run is recorded
    in its run directory only; the tracking store is not even created."""
    doc = spec_doc(digits_dataset, epochs=None, steps=3, data__workers=0, tracking__enabled=False)
    result = train(validate_train_spec(doc), tmp_path / "run")
    assert result.exit_code == 0 and result.run_id is None
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["status"] == "succeeded" and meta.get("mlflow_run_id") is None, meta
    assert not (vl_home / "mlflow.db").exists()
    # Switching it on for a resumption is allowed: it changes what is recorded, not the run.
    doc["tracking"]["enabled"] = True
    again = train(validate_train_spec(doc), tmp_path / "run")
    assert again.exit_code == 0 and again.step == 3


def test_tracked_run_records_spec_params_metrics_and_artifacts(tmp_path: Path, digits_dataset: Path) -> None:
    from mlflow.tracking import MlflowClient

    from visionloop.core.settings import load_settings

    doc = spec_doc(digits_dataset, epochs=1, data__workers=0)
    result = train(validate_train_spec(doc), tmp_path / "run")
    client = MlflowClient(load_settings().tracking_uri)
    run = client.get_run(str(result.run_id))
    assert run.info.status == "FINISHED"
    assert run.data.params["optimizer.lr"] == "0.003" and run.data.params["model.arch"] == "small_cnn"
    tags = run.data.tags
    manifest = json.loads((digits_dataset / "dataset.json").read_text())
    assert tags["visionloop.dataset_version"] == manifest["version"]
    assert tags["visionloop.run_dir"] == str((tmp_path / "run").resolve())
    assert "visionloop.env.torch" in tags and tags["visionloop.world_size"] == "1"
    steps = result.total_steps
    for key in ("train/loss", "train/lr", "train/images_per_s"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == list(range(1, steps + 1))
    for key in ("val/accuracy", "val/loss", "val/macro_f1", "val/precision/3", "val/recall/7"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [steps], key
    assert run.data.metrics["val/accuracy"] == pytest.approx(result.final_metrics["accuracy"])
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    assert artifacts == {"model/final.safetensors", "model/model_card.json"}
    eval_files = {a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(run.info.run_id, "eval")}
    assert {"confusion_matrix.png", "report.json"} <= eval_files
    spec_files = {a.path for a in client.list_artifacts(run.info.run_id, "spec")}
    assert spec_files == {"spec/spec.yaml", "spec/spec.resolved.yaml"}


def test_library_call_from_a_thread_can_be_stopped(tmp_path: Path, digits_dataset: Path) -> None:
    """Signal handlers exist only on the main thread; a thread uses StopRequest.request."""
    doc = spec_doc(digits_dataset, epochs=None, steps=50, data__workers=0)
    stop = StopRequest()
    box: dict[str, object] = {}

    class Trip(Recorder):
        def step(self, step: int, loss: float | None, lr: float, images_per_s: float | None) -> None:
            if step == 2:
                stop.request("test")

    t = threading.Thread(
        target=lambda: box.update(
            r=train(validate_train_spec(doc), tmp_path / "r", reporter=Trip(), track=False, stop=stop)
        )
    )
    t.start()
    t.join(timeout=300)
    result = box["r"]
    assert getattr(result, "exit_code", None) == 75 and getattr(result, "step", None) == 2


def test_a_tracked_run_resumes_with_changed_execution_fields(tmp_path: Path, digits_dataset: Path) -> None:
    from mlflow.tracking import MlflowClient

    from visionloop.core.settings import load_settings

    doc = spec_doc(digits_dataset, epochs=None, steps=6, data__workers=0)
    stop = StopRequest()

    class StopAt2(Recorder):
        def step(self, step: int, loss: float | None, lr: float, images_per_s: float | None) -> None:
            if step == 2:
                stop.request("test")

    first = train(validate_train_spec(doc), tmp_path / "run", reporter=StopAt2(), stop=stop)
    assert first.exit_code == 75
    doc["data"]["workers"] = 1
    doc["checkpoint"]["every_steps"] = 2
    second = train(validate_train_spec(doc), tmp_path / "run")
    assert second.exit_code == 0 and second.run_id == first.run_id
    run = MlflowClient(load_settings().tracking_uri).get_run(str(second.run_id))
    assert run.data.tags["visionloop.spec.data.workers"] == "1"
    assert "data.workers" not in run.data.params and run.data.params["data.batch_size"] == "64"


def test_a_diverging_loss_stops_the_run_with_advice(tmp_path: Path, digits_dataset: Path) -> None:
    from visionloop.core.errors import TrainingError

    doc = spec_doc(
        digits_dataset,
        epochs=None,
        steps=30,
        data__workers=0,
        optimizer={"name": "sgd", "lr": 1e12, "momentum": 0.0},
        schedule={"name": "constant"},
    )
    with pytest.raises(TrainingError, match=r"the training loss became (nan|inf).*Lower optimizer\.lr"):
        train(validate_train_spec(doc), tmp_path / "run", track=False)
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["status"] == "failed" and "training loss became" in meta["error"]


def test_resuming_on_a_changed_dataset_is_refused(tmp_path: Path, digits_dataset: Path) -> None:
    import shutil

    from visionloop.core.errors import TrainingError

    data = tmp_path / "data"
    shutil.copytree(digits_dataset, data)
    doc = spec_doc(data, epochs=None, steps=6, data__workers=0)
    stop = StopRequest()

    class StopAt2(Recorder):
        def step(self, step: int, loss: float | None, lr: float, images_per_s: float | None) -> None:
            if step == 2:
                stop.request("test")

    assert (
        train(
            validate_train_spec(doc), tmp_path / "run", reporter=StopAt2(), track=False, stop=stop
        ).exit_code
        == 75
    )
    manifest = json.loads((data / "dataset.json").read_text())
    manifest["version"] = "0" * 64  # as if re-ingested from changed images
    (data / "dataset.json").write_text(json.dumps(manifest))
    with pytest.raises(TrainingError, match="trained on dataset version"):
        train(validate_train_spec(doc), tmp_path / "run", track=False)
