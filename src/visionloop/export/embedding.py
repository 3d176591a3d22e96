"""The embedding output of an export: each image's penultimate-layer features, reduced by PCA.

    layer = task.embedding_layer(module)                   # where the features are read
    feats = collect_features(module, layer, batches)      # eager, on validation images
    projection = fit_projection(feats, components=16)     # PCA, numpy
    wrapped = WithEmbedding(module, layer, projection)    # returns (*outputs, embedding)

The projection is part of the exported graph (a subtraction and one matrix product after the
network), so every runtime and precision that serves the model gives the same 16 numbers per
image, the server logs them with each prediction (`serve.record.MonitorFields.embedding`),
the monitor's MMD test compares them with the version's reference, and label selection
spreads its picks over them (k-center). Fitted on the validation split at export, so the
components are those of the data the model was validated on: drift shows up as traffic
leaving the subspace's usual region, which MMD sees (Rabanser et al., "Failing Loudly", find
MMD on a reduced representation among the best multivariate detectors).

Why 16 components: the log line stays small (16 numbers, ~200 bytes), MMD's median-heuristic
kernel works best in a few tens of dimensions, and for the demo's CNN 16 components keep most
of the variance of the 64-128 pooled features (the report records the share kept).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor, nn

from visionloop.tasks import EmbeddingLayer

DEFAULT_COMPONENTS = 16
# Images the PCA is fitted on (the first of the validation split's batches): enough for 16
# stable components, cheap next to the export's own parity pass over the split.
MAX_FIT_IMAGES = 2000


@dataclass(frozen=True)
class Projection:
    mean: npt.NDArray[np.float32]  # (features,)
    components: npt.NDArray[np.float32]  # (k, features), orthonormal rows
    explained: float  # share of the features' variance the k components keep
    images: int  # how many images it was fitted on

    @property
    def dim(self) -> int:
        return int(self.components.shape[0])


def _pooled(value: Any) -> Tensor:
    """A hook's value as (N, features): a tensor, or the last tensor of a dict/list/tuple;
    a feature map (N, C, H, W) averaged over H and W."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        tensors = [v for v in value if isinstance(v, Tensor)]
        if not tensors:
            raise ValueError("the embedding layer gave no tensor")
        value = tensors[-1]
    if not isinstance(value, Tensor):
        raise ValueError(f"the embedding layer gave a {type(value).__name__}, not a tensor")
    if value.dim() == 4:
        value = value.mean(dim=(2, 3))
    pooled: Tensor = value.flatten(1).float()
    return pooled


class _Capture:
    """A forward hook on the layer, holding what it saw in the last forward pass."""

    def __init__(self, layer: EmbeddingLayer) -> None:
        self.layer = layer
        self.value: Tensor | None = None

    def __enter__(self) -> _Capture:
        def hook(_module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            self.value = _pooled(args[0] if self.layer.read == "input" else output)

        self._handle = self.layer.module.register_forward_hook(hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()

    def take(self) -> Tensor:
        if self.value is None:
            raise ValueError("the embedding layer did not run in the forward pass")
        value, self.value = self.value, None
        return value


def collect_features(
    module: nn.Module, layer: EmbeddingLayer, batches: Iterable[Tensor], *, limit: int = MAX_FIT_IMAGES
) -> npt.NDArray[np.float32]:
    """The pooled features of `layer` for the images of `batches` (eager, eval mode, no
    gradients), up to `limit` images: (images, features)."""
    out: list[npt.NDArray[np.float32]] = []
    seen = 0
    module.eval()
    with torch.no_grad(), _Capture(layer) as capture:
        for images in batches:
            module(images)
            feats = capture.take().numpy().astype(np.float32)
            out.append(feats)
            seen += len(feats)
            if seen >= limit:
                break
    if not out:
        raise ValueError("no images to fit the embedding's projection on")
    return np.concatenate(out)[:limit]


def fit_projection(features: npt.NDArray[Any], components: int = DEFAULT_COMPONENTS) -> Projection:
    """PCA of `features` (images, d): the mean and the top `components` principal axes
    (fewer when there are fewer features or images). Signs are fixed (each axis's largest
    coordinate positive) so the same data always gives the same projection."""
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or len(x) < 2:
        raise ValueError(f"need at least 2 images of features to fit a projection, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("the features hold NaN or infinity; the model's weights are broken")
    mean = x.mean(axis=0)
    centred = x - mean
    _, s, vt = np.linalg.svd(centred, full_matrices=False)
    k = max(1, min(components, vt.shape[0], len(x) - 1))
    axes = vt[:k]
    signs = np.sign(axes[np.arange(k), np.abs(axes).argmax(axis=1)])
    axes = axes * np.where(signs == 0, 1.0, signs)[:, None]
    total = float((s**2).sum())
    explained = float((s[:k] ** 2).sum() / total) if total > 0 else 1.0
    return Projection(mean.astype(np.float32), axes.astype(np.float32), explained, len(x))


class WithEmbedding(nn.Module):
    """`module`'s outputs followed by the projected embedding (N, k): what the export traces."""

    def __init__(self, module: nn.Module, layer: EmbeddingLayer, projection: Projection) -> None:
        super().__init__()
        self.module = module
        self.layer = layer
        self.register_buffer("pca_mean", torch.from_numpy(projection.mean.copy()))
        self.register_buffer("pca_components", torch.from_numpy(projection.components.copy()))

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        with _Capture(self.layer) as capture:
            out = self.module(x)
            feats = capture.take()
        outputs = tuple(out) if isinstance(out, tuple | list) else (out,)
        mean, components = self.get_buffer("pca_mean"), self.get_buffer("pca_components")
        return (*outputs, (feats - mean) @ components.T)
