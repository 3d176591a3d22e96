"""Test helper: a real trained and registered tiny model, built once per test session.

    from _modelkit import registered_model   # a session fixture: import it into the module

    def test_something(registered_model: ModelKit, tmp_path: Path) -> None:
        kit = registered_model.copy_home(tmp_path / "home")   # a private home to change freely
        info = kit.info()                                      # ModelVersionInfo of digits/1
        ...

The model is a small_cnn trained for 2 epochs on scikit-learn's digits at 16x16 (about 98%
validation accuracy), trained by the real trainer with MLflow tracking, registered as `digits`
version 1 and aliased `champion`. It lives in its own home under pytest's base temp folder, not
in the per-test home of conftest's `vl_home`: pass `kit.settings` to library calls, or
`env=kit.env()` to `_trainkit.cli(...)`. The shared home is read-only by convention; a test that
registers, moves aliases or exports uses `copy_home` first. `exported_model` adds the fp32 ONNX
export (gate passed) to a copy of it.
"""

from __future__ import annotations

import fcntl
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from _mlflowkit import copy_migrated_store
from _trainkit import spec_doc, write_spec
from visionloop.core.settings import Settings
from visionloop.registry import ModelVersionInfo

MODEL_NAME = "digits"


@dataclass(frozen=True)
class ModelKit:
    home: Path
    name: str
    version: int
    run_dir: Path
    dataset: Path

    @property
    def settings(self) -> Settings:
        return Settings(home=self.home, tracking_uri=f"sqlite:///{self.home / 'mlflow.db'}")

    @property
    def ref(self) -> str:
        return f"{self.name}/{self.version}"

    def env(self) -> dict[str, str]:
        """Environment for a CLI subprocess that should see this home."""
        return {"VISIONLOOP_HOME": str(self.home), "VISIONLOOP_TRACKING_URI": self.settings.tracking_uri}

    def info(self) -> ModelVersionInfo:
        from visionloop.registry import get_version

        return get_version(self.ref, self.settings)

    def copy_home(self, dest: Path) -> ModelKit:
        """A private copy of the home (MLflow store, registered files, the run) to change freely.

        The copied MLflow run still points at the original run directory, which stays intact.
        """
        shutil.copytree(self.home, dest, ignore=shutil.ignore_patterns("*.lock", ".lock", "*.init-lock"))
        return replace(self, home=dest)


def _build(root: Path, dataset: Path, factory: pytest.TempPathFactory) -> ModelKit:
    from visionloop.registry import register, set_alias
    from visionloop.specs import load_train_spec
    from visionloop.train.api import train

    home = root / "home"
    copy_migrated_store(factory, home)
    settings = Settings(home=home, tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    spec_path = write_spec(root / "digits.yaml", spec_doc(dataset, data__workers=0))
    spec, resolved = load_train_spec(spec_path)
    run_dir = home / "runs" / "digits-cnn"
    result = train(spec, run_dir, spec_text=spec_path.read_text(), resolved=resolved, settings=settings)
    assert result.exit_code == 0, result
    info = register(run_dir, name=MODEL_NAME, settings=settings)
    set_alias(MODEL_NAME, info.version, "champion", actor="modelkit", settings=settings)
    return ModelKit(home=home, name=MODEL_NAME, version=info.version, run_dir=run_dir, dataset=dataset)


def trained_model(factory: pytest.TempPathFactory, dataset: Path) -> ModelKit:
    """The session's trained + registered model, built on first use (under a file lock, so the
    importing modules of one session share it)."""
    root = factory.getbasetemp() / "modelkit"
    root.mkdir(exist_ok=True)
    done = root / "done"
    with open(root / ".build-lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        if not done.is_file():
            shutil.rmtree(root / "home", ignore_errors=True)  # a build that failed halfway
            kit = _build(root, dataset, factory)
            done.write_text(str(kit.version))
        version = int(done.read_text())
    home = root / "home"
    return ModelKit(
        home=home, name=MODEL_NAME, version=version, run_dir=home / "runs" / "digits-cnn", dataset=dataset
    )


def exported_model(factory: pytest.TempPathFactory, dataset: Path) -> ModelKit:
    """A copy of the session's model with its fp32 ONNX export (passed its gate), built once."""
    from visionloop.export import export_model

    base = trained_model(factory, dataset)
    root = factory.getbasetemp() / "modelkit-onnx"
    root.mkdir(exist_ok=True)
    done = root / "done"
    with open(root / ".build-lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        if not done.is_file():
            shutil.rmtree(root / "home", ignore_errors=True)
            kit = base.copy_home(root / "home")
            export_model(kit.ref, fmt="onnx", precision="fp32", settings=kit.settings)
            done.write_text("ok")
    return replace(base, home=root / "home")


@pytest.fixture(scope="session")
def registered_model(tmp_path_factory: pytest.TempPathFactory, digits_dataset: Path) -> ModelKit:
    return trained_model(tmp_path_factory, digits_dataset)


@pytest.fixture(scope="session")
def onnx_model(tmp_path_factory: pytest.TempPathFactory, digits_dataset: Path) -> ModelKit:
    return exported_model(tmp_path_factory, digits_dataset)


def flip_labels(kit: ModelKit, root: Path, flips: int, seed: int) -> tuple[Path, dict[int, str]]:
    """A new version of `kit`'s dataset under `root/ds` with `flips` train labels changed to
    another class (seeded; `data add` relabels the same records), and each flipped record's
    true label, by record index: label errors planted where the answer is known."""
    import random

    from visionloop.data.derive import add_images
    from visionloop.data.manifest import read_manifest
    from visionloop.data.shards import ShardReader

    m = read_manifest(kit.dataset)
    reader = ShardReader(kit.dataset / "shards" / "train")
    rng = random.Random(seed)
    truth: dict[int, str] = {}
    for pos in rng.sample(range(len(reader)), flips):
        r = reader[pos]
        wrong = m.classes[(int(r["label"]) + rng.randrange(1, len(m.classes))) % len(m.classes)]
        (root / "flips" / wrong).mkdir(parents=True, exist_ok=True)
        (root / "flips" / wrong / f"{pos}.png").write_bytes(r["image"])
        truth[int(r["index"])] = m.classes[int(r["label"])]
    add_images(kit.dataset, root / "flips", root / "ds", workers=1)
    return root / "ds", truth
