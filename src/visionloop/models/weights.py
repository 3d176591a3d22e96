"""Model weights on disk: safetensors out; safetensors or weights-only `.pt`/`.pth` in.

Loaders also take safetensors as bytes already in memory: a registered version's weights are
read once, checked against the sha256 recorded at registration, and those very bytes are loaded
(`registry.ModelVersionInfo.verified_weights_bytes`), never the path again.

Nothing here unpickles arbitrary objects: `.pt` files are read with
`torch.load(weights_only=True)`, so a file can carry tensors and plain containers but never
code. Keys are normalised on both sides — the `module.` prefix of DDP and the `_orig_mod.`
component of `torch.compile` are stripped — so weights saved from a wrapped model load into
a bare one.
"""

from __future__ import annotations

import io
import logging
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from visionloop.core.errors import CheckpointError
from visionloop.core.fsutil import TooLargeError, atomic_write_bytes, read_capped

log = logging.getLogger(__name__)

SAFETENSORS_SUFFIX = ".safetensors"
TORCH_SUFFIXES = (".pt", ".pth")
# Containers that training scripts commonly wrap a state dict in.
_WRAPPER_KEYS = ("state_dict", "model", "model_state_dict")
_SHOW = 5  # keys named in an error message, per kind
# The most bytes of safetensors read into memory at once (a weights file, a registered
# version's weights). The largest architecture visionloop builds, torchvision's regnet_y_128gf
# (ViT-H/14 is close), is about 645M parameters: 2.6 GB in fp32. 16 GiB is six times that, room
# for a larger custom model, while a file past it is not a model this platform trains: loading
# holds the bytes and the tensors made from them (twice the file) in memory at once.
MAX_WEIGHTS_BYTES = 16 * 2**30


class WeightsError(CheckpointError):
    """A weights file cannot be read, or does not fit the model."""


# --------------------------------------------------------------------------- keys


def strip_wrapper_prefixes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove DDP's leading `module.` and torch.compile's `_orig_mod.` from every key.

    `module.` is stripped only when *every* key carries it (that is what DDP produces; a model
    may legitimately have a submodule called `module`). `_orig_mod.` is never a real module
    name, so it is removed wherever it appears (compiling a submodule puts it mid-key).
    """
    keys = [k.replace("._orig_mod.", ".") for k in state_dict]
    while keys:
        for prefix in ("module.", "_orig_mod."):
            if all(k.startswith(prefix) for k in keys):
                keys = [k[len(prefix) :] for k in keys]
                break
        else:
            break
    if len(set(keys)) != len(keys):
        raise WeightsError(
            "stripping DDP/compile prefixes (`module.`, `_orig_mod.`) makes two keys collide; "
            "save the weights of the unwrapped model (`model.module` for DDP) instead."
        )
    return dict(zip(keys, state_dict.values(), strict=True))


# --------------------------------------------------------------------------- save / load


def save_weights(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    path: Path,
    *,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write weights as safetensors, atomically; return the path.

    Accepts a module (wrapped in DDP or torch.compile or not) or a state dict. Tensors are
    copied to CPU; tensors that share storage (tied weights) or are views are copied to
    compact storage of their own, which safetensors requires. Loading restores ties, because
    `load_state_dict` copies into each tied parameter.
    """
    path = Path(path)
    if path.suffix != SAFETENSORS_SUFFIX:
        raise WeightsError(
            f"save_weights writes safetensors; name the file *{SAFETENSORS_SUFFIX}, not {path.name}."
        )
    if isinstance(model_or_state_dict, nn.Module):
        state: Mapping[str, Any] = model_or_state_dict.state_dict()
    else:
        state = model_or_state_dict
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise WeightsError(
            f"only tensors can be saved as weights; {len(bad)} value(s) are not: {bad[:_SHOW]}. "
            "Pass model.state_dict(), or keep non-tensor state (step, config) in a checkpoint."
        )
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[torch.device, int]] = set()
    for key, value in strip_wrapper_prefixes(state).items():
        t = value.detach().cpu()
        storage = t.untyped_storage()
        ident = (t.device, storage.data_ptr())
        compact = t.is_contiguous() and storage.nbytes() == t.numel() * t.element_size()
        if ident in seen or not compact:
            t = t.clone(memory_format=torch.contiguous_format)
        if storage.data_ptr() != 0:  # empty tensors all have pointer 0 and share nothing
            seen.add(ident)
        tensors[key] = t
    data = st_save(tensors, metadata=dict(metadata) if metadata else None)
    atomic_write_bytes(path, data)
    return path


def load_weights(source: Path | bytes) -> dict[str, torch.Tensor]:
    """Read a state dict from `.safetensors`, or from a weights-only `.pt`/`.pth` file; or from
    safetensors bytes already read (bytes are always safetensors).

    A `.pt` may hold the state dict itself or wrap it as `{"state_dict": ...}`,
    `{"model": ...}` or `{"model_state_dict": ...}` (extra entries such as an optimizer are
    ignored). Wrapper prefixes (`module.`, `_orig_mod.`) are stripped from the keys.
    """
    if isinstance(source, bytes):
        what = describe_weights(source)
        return strip_wrapper_prefixes(_unwrap(_safetensors(source, what), what))
    path = Path(source)
    if not path.is_file():
        raise WeightsError(
            f"weights file {path} does not exist; "
            f"give the path of a {SAFETENSORS_SUFFIX}, .pt or .pth state dict."
        )
    suffix = path.suffix.lower()
    if suffix == SAFETENSORS_SUFFIX:
        try:
            # read_capped: a FIFO put in its place after the is_file() above is refused, not
            # waited on; a file past MAX_WEIGHTS_BYTES is refused before it fills the memory.
            data = read_capped(path, MAX_WEIGHTS_BYTES, what="a weights file")
        except (OSError, TooLargeError) as e:
            raise WeightsError(
                f"{path} is not a readable safetensors file ({e}); is it truncated? Re-export it."
            ) from e
        raw: Any = _safetensors(data, str(path))
    elif suffix in TORCH_SUFFIXES:
        raw = _torch_load(path)
    else:
        raise WeightsError(
            f"{path.name}: unsupported weights format {suffix or '(no suffix)'}; "
            f"use {SAFETENSORS_SUFFIX} (preferred), .pt or .pth."
        )
    return strip_wrapper_prefixes(_unwrap(raw, str(path)))


def describe_weights(source: Path | bytes) -> str:
    """How messages name weights: the file's path, or what the bytes are (never the bytes)."""
    if isinstance(source, bytes):
        return f"the safetensors weights given as bytes ({len(source)} bytes)"
    return str(source)


def _safetensors(data: bytes, what: str) -> dict[str, torch.Tensor]:
    try:
        raw: dict[str, torch.Tensor] = st_load(data)
    except SafetensorError as e:
        raise WeightsError(
            f"{what} is not a readable safetensors file ({e}); is it truncated? Re-export it."
        ) from e
    return raw


def _torch_load(path: Path) -> Any:
    # Read through read_capped as safetensors are: torch.load(path) would wait for ever on a
    # FIFO put in the file's place and read a file of any size.
    try:
        data = read_capped(path, MAX_WEIGHTS_BYTES, what="a weights file")
    except (OSError, TooLargeError) as e:
        raise WeightsError(
            f"{path} is not a readable PyTorch file ({e}); is it truncated? Re-export it."
        ) from e
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # weights_only refuses any class it does not know: typically torch.save(model).
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise WeightsError(
            f"{path} holds pickled Python objects, not just tensors (e.g. a whole model saved with "
            f"`torch.save(model)`): {first}. visionloop loads only state dicts, because unpickling "
            "can run arbitrary code. If you trust the file, re-save its weights once: "
            "`torch.save(torch.load(PATH, weights_only=False).state_dict(), 'weights.pt')`."
        ) from e
    except (RuntimeError, OSError, EOFError) as e:
        raise WeightsError(
            f"{path} is not a readable PyTorch file ({e}); is it truncated? Re-export it."
        ) from e


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def _unwrap(raw: Any, what: str) -> Mapping[str, torch.Tensor]:
    if _is_state_dict(raw):
        return dict(raw)
    if isinstance(raw, Mapping):
        for key in _WRAPPER_KEYS:
            if _is_state_dict(raw.get(key)):
                return dict(raw[key])
        shown = {str(k): type(v).__name__ for k, v in list(raw.items())[:8]}
        raise WeightsError(
            f"{what} holds a dict without a state dict in it (top-level entries: {shown}). "
            f"Expected tensors by parameter name, or one of them under {list(_WRAPPER_KEYS)}."
        )
    raise WeightsError(f"{what} holds a {type(raw).__name__}, not a state dict of tensors.")


# --------------------------------------------------------------------------- pretrained


@dataclass(frozen=True)
class LoadReport:
    """What `load_pretrained` did: loaded keys, and head keys kept at their fresh init.
    `path` is None for weights given as bytes."""

    path: Path | None
    loaded: tuple[str, ...]
    skipped: tuple[str, ...]
    head: str | None

    def summary(self) -> str:
        text = f"loaded {len(self.loaded)} tensors from {self.path or 'the weights given as bytes'}"
        if self.skipped:
            text += f"; kept the new classifier head ({', '.join(self.skipped)})"
        return text


def find_classifier(model: nn.Module) -> str | None:
    """Name of the module that produces the logits: the last `nn.Linear`/`nn.Conv2d`.

    True of every torchvision classification model (`fc`, `classifier.1`, `heads.head`,
    squeezenet's `classifier.1` conv) and of the native ones; the head is registered last.
    """
    last = None
    for name, module in model.named_modules():
        if name and isinstance(module, nn.Linear | nn.Conv2d):
            last = name
    return last


def load_pretrained(model: nn.Module, weights: Path | bytes, *, head: str | None = None) -> LoadReport:
    """Load a local weights file (or safetensors bytes) into `model`, tolerating only a
    differently sized head.

    Tensors of the classifier head (`head`, default `find_classifier(model)`) whose shapes
    differ from the file — a file trained for another number of classes — or that the file
    lacks are skipped and keep their initialisation. Any other missing, unexpected or
    mismatched key is an error, and then nothing is loaded.
    """
    path = None if isinstance(weights, bytes) else Path(weights)
    file_sd = load_weights(weights if path is None else path)
    model_sd = model.state_dict()
    head = head if head is not None else find_classifier(model)

    def in_head(key: str) -> bool:
        return head is not None and key.startswith(head + ".")

    # Keys listed in the model's order (unexpected ones sorted): safetensors reorders keys.
    unexpected = sorted(k for k in file_sd if k not in model_sd)
    missing = [k for k in model_sd if k not in file_sd]
    mismatched = [k for k in model_sd if k in file_sd and file_sd[k].shape != model_sd[k].shape]
    skipped = [k for k in model_sd if in_head(k) and (k in missing or k in mismatched)]
    bad_missing = [k for k in missing if not in_head(k)]
    bad_mismatched = [k for k in mismatched if not in_head(k)]
    if unexpected or bad_missing or bad_mismatched:
        raise WeightsError(
            _explain_misfit(
                model, describe_weights(weights), file_sd, model_sd, unexpected, bad_missing, bad_mismatched
            )
        )

    to_load = {k: v for k, v in file_sd.items() if k not in mismatched}
    result = model.load_state_dict(to_load, strict=False)
    # Everything was checked above; a disagreement here would be a bug in that check.
    if set(result.missing_keys) != set(skipped) or result.unexpected_keys:
        raise AssertionError(f"load_state_dict disagrees with the key check: {result}")
    report = LoadReport(path=path, loaded=tuple(to_load), skipped=tuple(skipped), head=head)
    for k in skipped:
        shape = tuple(file_sd[k].shape) if k in file_sd else "absent"
        log.info("pretrained: %s kept at init (file %s, model %s)", k, shape, tuple(model_sd[k].shape))
    log.info("pretrained: %s", report.summary())
    return report


def _explain_misfit(
    model: nn.Module,
    what: str,
    file_sd: Mapping[str, torch.Tensor],
    model_sd: Mapping[str, torch.Tensor],
    unexpected: list[str],
    missing: list[str],
    mismatched: list[str],
) -> str:
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing from the file {missing[:_SHOW]}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected in the file {unexpected[:_SHOW]}")
    if mismatched:
        shapes = [
            f"{k}: file {tuple(file_sd[k].shape)} vs model {tuple(model_sd[k].shape)}" for k in mismatched
        ]
        parts.append(f"{len(mismatched)} with other shapes [{'; '.join(shapes[:_SHOW])}]")
    return (
        f"{what} does not fit this {type(model).__name__}: {', '.join(parts)}. "
        f"Likely cause: {_likely_cause(model_sd, unexpected, missing)} "
        "Nothing was loaded."
    )


def _likely_cause(
    model_sd: Mapping[str, torch.Tensor],
    unexpected: list[str],
    missing: list[str],
) -> str:
    if unexpected and any(k.split(".")[0] in ("AuxLogits", "aux1", "aux2") for k in unexpected):
        return (
            "the file has auxiliary-classifier weights; build the model with aux_logits=True in model kwargs."
        )
    if unexpected and missing:
        firsts = {k.split(".", 1)[0] for k in unexpected}
        if len(firsts) == 1:
            prefix = next(iter(firsts)) + "."
            hits = sum(k[len(prefix) :] in model_sd for k in unexpected)
            if hits and 2 * hits >= len(unexpected):
                return f"the file's keys carry a {prefix!r} prefix; re-save the state dict without it."
        return "the file was saved from a different architecture; check `model.arch` against the file."
    if unexpected or missing:
        return "a different architecture or variant; check `model.arch` and `model.kwargs` against the file."
    return (
        "the same family but another variant, width or input channel count "
        "(e.g. resnet34 weights for resnet18, or different `model.kwargs`)."
    )
