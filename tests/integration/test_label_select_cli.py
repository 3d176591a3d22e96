"""`visionloop label select` as a user runs it: a folder of unlabelled images scored by the
served export of the session's digits model, training-set copies left out, unreadable files
skipped, the most uncertain picked first, and a clear refusal where the export lacks what a
strategy needs."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image

from _modelkit import ModelKit, onnx_model
from _trainkit import cli
from visionloop.data.manifest import SplitName, read_manifest, shard_dir_of
from visionloop.data.shards import ShardReader
from visionloop.export import export_model

__all__ = ["onnx_model"]


def _split_images(kit: ModelKit, split: SplitName, n: int) -> list[bytes]:
    manifest = read_manifest(kit.dataset)
    reader = ShardReader(shard_dir_of(kit.dataset, manifest.splits[split]))
    return [bytes(r["image"]) for r in reader.read_many(list(range(min(n, len(reader)))))]


def _noise(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def pool(onnx_model: ModelKit, tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelKit, Path]:
    kit = onnx_model.copy_home(tmp_path_factory.mktemp("label") / "home")
    src = tmp_path_factory.mktemp("unlabelled")
    for i, data in enumerate(_split_images(kit, "val", 30)):
        (src / f"val-{i:02d}.png").write_bytes(data)
    for i, data in enumerate(_split_images(kit, "train", 4)):
        (src / "copies").mkdir(exist_ok=True)
        (src / "copies" / f"train-{i}.png").write_bytes(data)  # already labelled
    for i in range(6):
        (src / f"noise-{i}.png").write_bytes(_noise(i))
    (src / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (src / "notes.txt").write_text("not an image")
    return kit, src


def _entropy_of(kit: ModelKit, files: list[Path]) -> dict[str, float]:
    """Each file's entropy from the served ONNX file, computed here, independently."""
    from visionloop.serve.images import decode_image, needed_side

    card = kit.info().card()
    pre = card.eval_preprocess()
    session = ort.InferenceSession(str(kit.info().dir / "exports" / "onnx-fp32" / "model.onnx"))
    out = {}
    for f in files:
        x = decode_image(f.read_bytes(), pre.to_transform(), np.dtype(np.float32), needed_side(pre)).input
        logits = session.run(["logits"], {"input": x})[0][0].astype(np.float64)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        out[f.name] = float(-(p * np.log(np.where(p > 0, p, 1.0))).sum())
    return out


def test_select_picks_the_most_uncertain_and_leaves_out_training_copies(
    pool: tuple[ModelKit, Path], tmp_path: Path
) -> None:
    kit, src = pool
    sel, copies = tmp_path / "selection.json", tmp_path / "to-label"
    r = cli(
        "label", "select", kit.name, "--from", str(src), "--budget", "5", "--strategy", "entropy",
        "--out", str(sel), "--copy-to", str(copies), env=kit.env(),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(sel.read_text())
    assert doc["model"] == kit.ref and doc["images"] == 40  # 30 + 4 + 6 readable
    assert [s["file"] for s in doc["skipped"]] == ["broken.png"]
    chosen = [c["id"] for c in doc["chosen"]]
    assert len(chosen) == 5 and not any(c.startswith("copies/") for c in chosen)
    # Every training copy is left out as a near-duplicate of a training image.
    dup = {d["id"]: d for d in doc["near_duplicates"]}
    assert {f"copies/train-{i}.png" for i in range(4)} <= set(dup)
    assert all(dup[f"copies/train-{i}.png"]["of_training"] for i in range(4))
    # The picks are the 5 highest entropies among the images not left out, in order.
    candidates = [p for p in sorted(src.rglob("*.png")) if p.name != "broken.png"]
    entropy = _entropy_of(kit, candidates)
    kept = {p.relative_to(src).as_posix(): entropy[p.name] for p in candidates}
    kept = {k: v for k, v in kept.items() if k not in dup}
    best = sorted(kept, key=lambda k: -kept[k])[:5]
    assert chosen == best, (chosen, best)
    assert [c["score"] for c in doc["chosen"]] == pytest.approx([kept[k] for k in best], abs=1e-4)
    assert sorted(p.name for p in copies.iterdir()) == sorted(c.replace("/", "__") for c in chosen)
    # What a person reads: the table, what was left out, and what was skipped.
    said = " ".join(r.stdout.split())  # the console wraps long lines
    assert "5 of 40 images (entropy)" in said
    training = sum(d["of_training"] for d in dup.values())
    assert training >= 4  # the copies, and any validation digit that close to a training one
    assert f"left out {len(dup)} near-duplicates ({training} of training images" in said, said
    assert "skipped 1 unreadable files, e.g. broken.png" in said


def test_hybrid_spreads_over_the_embeddings_and_an_export_without_them_is_refused(
    pool: tuple[ModelKit, Path],
) -> None:
    kit, src = pool
    r = cli("label", "select", kit.name, "--from", str(src), "--budget", "4", "--json", env=kit.env())
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["strategy"] == "hybrid" and len(doc["chosen"]) == 4
    assert len({c["id"] for c in doc["chosen"]}) == 4
    # An fp16 export made without the embedding output: k-center cannot run on it.
    export_model(kit.ref, precision="fp16", embedding=False, settings=kit.settings)
    r = cli(
        "label", "select", kit.name, "--from", str(src), "--budget", "4", "--strategy", "kcenter",
        "--precision", "fp16", env=kit.env(),
    )  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "needs embeddings" in r.stderr and "visionloop export" in r.stderr
    # Entropy needs none: the same export answers.
    r = cli(
        "label", "select", kit.name, "--from", str(src), "--budget", "2", "--strategy", "entropy",
        "--precision", "fp16", "--json", env=kit.env(),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["chosen"]) == 2


def test_bad_input_is_named(pool: tuple[ModelKit, Path], tmp_path: Path) -> None:
    kit, src = pool
    r = cli("label", "select", kit.name, "--from", str(tmp_path / "nowhere"), "--budget", "3", env=kit.env())
    assert r.returncode != 0 and "is not a folder of images" in r.stderr and "Traceback" not in r.stderr
    r = cli(
        "label", "select", kit.name, "--from", str(src), "--budget", "3", "--strategy", "smart", env=kit.env()
    )
    assert r.returncode != 0 and "'smart' is not one of" in r.stderr and "hybrid" in r.stderr
    r = cli("label", "select", kit.name, "--from", str(src), "--budget", "0", env=kit.env())
    assert r.returncode == 2 and "--budget" in r.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("taken")
    r = cli(
        "label", "select", kit.name, "--from", str(src), "--budget", "3", "--copy-to", str(tmp_path / "full"),
        env=kit.env(),
    )  # fmt: skip
    assert r.returncode != 0 and "is not empty" in r.stderr


def test_export_skips_a_fifo_and_inlines_the_bytes_it_scored(
    pool: tuple[ModelKit, Path], tmp_path: Path
) -> None:
    """`label export --out`: each chosen image is read once, capped, and a FIFO in the folder is
    skipped with the reason (stat then read_bytes waited on it forever). The task's inline image
    is the very bytes the pre-annotation was made on."""
    import base64
    import os

    kit, src = pool
    folder = tmp_path / "chosen"
    folder.mkdir()
    good = (src / "val-00.png").read_bytes()
    (folder / "a.png").write_bytes(good)
    os.mkfifo(folder / "pipe.png")
    selection = tmp_path / "selection.json"
    chosen = [{"id": "a.png"}, {"id": "pipe.png"}]
    selection.write_text(json.dumps({"model": kit.name, "source": str(folder), "chosen": chosen}))
    out = tmp_path / "tasks"
    r = cli("label", "export", str(selection), "--out", str(out), env=kit.env(), timeout=120)
    assert r.returncode == 0, r.stderr
    said = " ".join(r.stderr.split())
    assert "skipped pipe.png:" in said and "FIFO" in said, said
    (task,) = json.loads((out / "tasks.json").read_text())
    assert task["data"]["image"] == "data:image/png;base64," + base64.b64encode(good).decode("ascii")
    (prediction,) = task["predictions"]
    assert prediction["model_version"] == kit.ref and 0 < prediction["score"] <= 1
