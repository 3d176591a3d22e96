"""A small anchor-free detector that trains from scratch on two CPU cores in minutes.

It speaks torchvision's detection model API, so a trainer, an evaluator or a server can hold
it exactly where they would hold `fasterrcnn_resnet50_fpn`:

    model = build_native_detector(num_classes=len(class_names) + 1)  # + 1: background, as torchvision
    model.train(); losses = model(images, targets)   # {"loss_heatmap": ..., "loss_box": ...}
    model.eval();  dets = model(images)               # [{"boxes", "scores", "labels"}] per image

- `images`: a list of (3, H, W) float tensors in [0, 1] (uint8 is divided by 255), any sizes.
- `targets`: a list of {"boxes": (N, 4) xyxy float in pixels of that image, "labels": (N,) int64}.
- Labels follow torchvision: 1..num_classes-1 are the classes, 0 is background and never
  predicted, and `num_classes` counts the background. `DetectionEvaluator` and the dataset
  use 0-based class indices (no background), so: model label = dataset label + 1 on the way
  in, evaluator label = model label - 1 on the way out — the same shift for every
  torchvision detector.
- Eval-mode `boxes` are xyxy in absolute pixels of each *input* image.

Design (CenterNet's heatmap of object centres, with TTFNet's Gaussian-weighted box
regression, which trains several times faster than regressing at the centre alone):
1. `letterbox` + `transform`: each image is letterboxed to `input_size`² (scaled so its longer
   side fits, padded bottom/right), then normalised; the scale is kept to map boxes back.
2. `forward_raw` (tensor in, fixed-shape tensors out: the part to export to ONNX): a 4-stage
   conv-BN-ReLU backbone (strides 2-16), a top-down neck back to stride 4, and two heads:
   class heatmap logits (B, C, H/4, W/4) and box regression (B, 4, H/4, W/4) = centre offset
   from the cell centre in strides (dx, dy), and log of width and height in strides.
3. `decode` (also fixed-shape, ONNX-expressible: MaxPool, TopK, Gather, Exp): peaks of the
   heatmap (a 3×3 max-pool keeps local maxima: CenterNet's NMS), the `topk` best over all
   classes, their boxes in letterboxed-input pixels: (B, K, 4), (B, K), (B, K).
   `forward_fixed` is 2 + 3 behind the normalisation: a letterboxed [0, 1] batch in, the
   fixed-shape decode out — the module to export (tests/unit export it to ONNX).
4. `postprocess` (per image, variable length: Python, not exported): score threshold,
   `torchvision.ops.batched_nms`, boxes divided by the letterbox scale and clipped to the
   image, labels shifted to torchvision's 1-based ones.

Losses: the penalty-reduced focal loss on the heatmap (CenterNet, α=2, β=4) over a Gaussian
per object whose spread follows the box (TTFNet, `gaussian_alpha`), and GIoU on the boxes
decoded at every cell where an object's Gaussian exceeds `box_region`, weighted by the
Gaussian and normalised so each object counts once. Both divide by the number of objects.

Deterministic on CPU under `torch.use_deterministic_algorithms(True)`: convolutions, batch
norm, ReLU, max pool, nearest upsampling and elementwise ops only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.ops import batched_nms, generalized_box_iou_loss

STRIDE = 4


def _conv_bn_relu(cin: int, cout: int, stride: int = 1, kernel: int = 3) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class _Head(nn.Module):
    def __init__(self, cin: int, width: int, cout: int) -> None:
        super().__init__()
        self.hidden = _conv_bn_relu(cin, width)
        self.out = nn.Conv2d(width, cout, 1)

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.out(self.hidden(x))
        return y


class NativeDetector(nn.Module):
    """See the module docstring. `widths` are the four backbone stages' channels (strides 2,
    4, 8, 16); `neck` the channels of the stride-8 and stride-4 maps the heads read."""

    mean: Tensor
    std: Tensor

    def __init__(
        self,
        num_classes: int,
        *,
        input_size: int = 96,
        widths: Sequence[int] = (16, 32, 64, 96),
        neck: int = 48,
        mean: Sequence[float] = (0.5, 0.5, 0.5),
        std: Sequence[float] = (0.25, 0.25, 0.25),
        score_thresh: float = 0.05,
        nms_thresh: float = 0.5,
        topk: int = 100,
        detections_per_img: int = 100,
        gaussian_alpha: float = 0.54,
        box_region: float = 0.3,
        box_loss_weight: float = 5.0,
    ) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(
                f"num_classes counts the background, as torchvision's: {num_classes} leaves no class; "
                "pass len(class_names) + 1, e.g. 11 for the ten digits"
            )
        if input_size % 16 != 0:
            raise ValueError(
                f"input_size must be a multiple of 16 (the backbone's stride), e.g. 96; got {input_size}"
            )
        if len(widths) != 4:
            raise ValueError(
                f"widths needs four entries (strides 2, 4, 8, 16), e.g. (16, 32, 64, 96); got {widths}"
            )
        self.num_classes = num_classes
        self.input_size = input_size
        self.score_thresh = score_thresh
        self.nms_thresh = nms_thresh
        self.topk = topk
        self.detections_per_img = detections_per_img
        self.gaussian_alpha = gaussian_alpha
        self.box_region = box_region
        self.box_loss_weight = box_loss_weight
        self.register_buffer(
            "mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1), persistent=False
        )
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)

        w1, w2, w3, w4 = widths
        self.stage1 = nn.Sequential(_conv_bn_relu(3, w1, 2), _conv_bn_relu(w1, w1))  # /2
        self.stage2 = nn.Sequential(_conv_bn_relu(w1, w2, 2), _conv_bn_relu(w2, w2))  # /4
        self.stage3 = nn.Sequential(_conv_bn_relu(w2, w3, 2), _conv_bn_relu(w3, w3))  # /8
        self.stage4 = nn.Sequential(_conv_bn_relu(w3, w4, 2), _conv_bn_relu(w4, w4))  # /16
        self.lateral4 = _conv_bn_relu(w4, neck, kernel=1)
        self.lateral3 = _conv_bn_relu(w3, neck, kernel=1)
        self.lateral2 = _conv_bn_relu(w2, neck, kernel=1)
        self.smooth3 = _conv_bn_relu(neck, neck)
        self.smooth2 = _conv_bn_relu(neck, neck)
        self.heatmap = _Head(neck, neck, num_classes - 1)
        self.box = _Head(neck, neck, 4)
        # Start every cell at p = 0.01 (focal loss's prior): the heatmap loss starts small
        # instead of shouting "object" everywhere; boxes start at one stride, centred.
        assert self.heatmap.out.bias is not None and self.box.out.bias is not None
        nn.init.constant_(self.heatmap.out.bias, -math.log((1 - 0.01) / 0.01))
        nn.init.normal_(self.box.out.weight, std=0.01)
        nn.init.zeros_(self.box.out.bias)

    # -- 1. images → letterboxed batch ---------------------------------------------------------

    def letterbox(self, images: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """(B, 3, S, S) batch in [0, 1] and each image's scale (input pixels per image pixel):
        each image scaled so its longer side is S, at the top left, padded with the mean."""
        if len(images) == 0:
            raise ValueError("images is empty: pass a list of (3, H, W) tensors")
        s = self.input_size
        batch = self.mean.expand(len(images), 3, s, s).clone()
        scales = torch.empty(len(images), device=self.mean.device)
        for i, image in enumerate(images):
            if image.ndim != 3 or image.shape[0] != 3:
                raise ValueError(f"image {i} has shape {tuple(image.shape)}; expected (3, H, W)")
            x = image.float() / 255.0 if image.dtype == torch.uint8 else image.float()
            h, w = int(image.shape[1]), int(image.shape[2])
            scale = s / max(h, w)
            nh, nw = min(s, round(h * scale)), min(s, round(w * scale))
            if (nh, nw) != (h, w):
                x = F.interpolate(x[None], size=(nh, nw), mode="bilinear", align_corners=False)[0]
            # Padded with the mean: zero after normalisation, like the network's own zero padding.
            batch[i, :, :nh, :nw] = x.to(batch.device)
            scales[i] = scale
        return batch, scales

    def transform(self, images: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """`letterbox`, normalised with the model's mean and std."""
        batch, scales = self.letterbox(images)
        return (batch - self.mean) / self.std, scales

    # -- 2. the network: fixed shapes in and out (export this) ---------------------------------

    def forward_raw(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Normalised (B, 3, S, S) → heatmap logits (B, C, S/4, S/4), box regression (B, 4, S/4, S/4)."""
        c2 = self.stage2(self.stage1(x))
        c3 = self.stage3(c2)
        c4 = self.stage4(c3)
        p3 = self.smooth3(
            self.lateral3(c3) + F.interpolate(self.lateral4(c4), scale_factor=2.0, mode="nearest")
        )
        p2 = self.smooth2(self.lateral2(c2) + F.interpolate(p3, scale_factor=2.0, mode="nearest"))
        heat: Tensor = self.heatmap(p2)
        box: Tensor = self.box(p2)
        return heat, box

    def _boxes_from_reg(self, reg: Tensor) -> Tensor:
        """(B, 4, H, W) regression → (B, H, W, 4) xyxy boxes in letterboxed-input pixels."""
        _, _, h, w = reg.shape
        ys = (torch.arange(h, device=reg.device, dtype=reg.dtype) + 0.5) * STRIDE
        xs = (torch.arange(w, device=reg.device, dtype=reg.dtype) + 0.5) * STRIDE
        cx = xs.view(1, 1, w) + reg[:, 0] * STRIDE
        cy = ys.view(1, h, 1) + reg[:, 1] * STRIDE
        # Clamped so that an untrained net cannot overflow exp: at most e^6 strides (~1600 px).
        half_w = torch.exp(reg[:, 2].clamp(max=6.0)) * (STRIDE / 2)
        half_h = torch.exp(reg[:, 3].clamp(max=6.0)) * (STRIDE / 2)
        return torch.stack([cx - half_w, cy - half_h, cx + half_w, cy + half_h], dim=-1)

    # -- 3. decode: fixed-shape, ONNX-expressible ----------------------------------------------

    def decode(self, heat_logits: Tensor, reg: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The `topk` heatmap peaks of each image: boxes (B, K, 4) xyxy in letterboxed-input
        pixels, scores (B, K) in [0, 1], labels (B, K) 0-based class indices."""
        b, c, h, w = heat_logits.shape
        heat = torch.sigmoid(heat_logits)
        peaks = heat * (F.max_pool2d(heat, 3, stride=1, padding=1) == heat).to(heat.dtype)
        k = min(self.topk, c * h * w)
        scores, index = peaks.flatten(1).topk(k, dim=1)
        labels = torch.div(index, h * w, rounding_mode="floor")
        cell = index % (h * w)
        boxes = self._boxes_from_reg(reg).reshape(b, h * w, 4)
        boxes = torch.gather(boxes, 1, cell[..., None].expand(b, k, 4))
        return boxes, scores, labels

    def forward_fixed(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """What to export: a letterboxed (B, 3, S, S) batch in [0, 1] (as `letterbox` makes it)
        → `decode`'s fixed-shape boxes, scores and 0-based labels. Normalisation is inside."""
        heat, reg = self.forward_raw((x - self.mean) / self.std)
        return self.decode(heat, reg)

    # -- 4. post-processing: per image, variable length ----------------------------------------

    def postprocess(
        self,
        boxes: Tensor,
        scores: Tensor,
        labels: Tensor,
        scales: Tensor,
        sizes: Sequence[tuple[int, int]],
    ) -> list[dict[str, Tensor]]:
        """`decode`'s output → torchvision's per-image dicts in each input image's pixels;
        `sizes` are the input images' (height, width)."""
        out: list[dict[str, Tensor]] = []
        for i, (h, w) in enumerate(sizes):
            keep = scores[i] >= self.score_thresh
            bx, sc, lb = boxes[i][keep] / scales[i], scores[i][keep], labels[i][keep]
            bx = torch.stack(
                [bx[:, 0].clamp(0, w), bx[:, 1].clamp(0, h), bx[:, 2].clamp(0, w), bx[:, 3].clamp(0, h)],
                dim=1,
            )
            valid = (bx[:, 2] > bx[:, 0]) & (bx[:, 3] > bx[:, 1])
            bx, sc, lb = bx[valid], sc[valid], lb[valid]
            kept = batched_nms(bx, sc, lb, self.nms_thresh)[: self.detections_per_img]
            out.append({"boxes": bx[kept], "scores": sc[kept], "labels": lb[kept] + 1})
        return out

    # -- training targets and losses -----------------------------------------------------------

    def encode(
        self, targets: Sequence[Mapping[str, Tensor]], scales: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Targets → heatmap (B, C, H, W) in [0, 1], box targets (B, H, W, 4) xyxy in input
        pixels and box weights (B, H, W), each object's weights summing to 1."""
        s = self.input_size // STRIDE
        c = self.num_classes - 1
        device = scales.device
        heat = torch.zeros(len(targets), c, s, s, device=device)
        box_t = torch.zeros(len(targets), s, s, 4, device=device)
        weight = torch.zeros(len(targets), s, s, device=device)
        grid = torch.arange(s, device=device, dtype=torch.float32)
        for i, target in enumerate(targets):
            boxes = target["boxes"].to(device=device, dtype=torch.float32).reshape(-1, 4) * scales[i]
            labels = target["labels"].to(device=device, dtype=torch.int64).reshape(-1)
            if len(boxes) == 0:
                continue
            if bool(((labels < 1) | (labels >= self.num_classes)).any()):
                raise ValueError(
                    f"target {i} has labels {labels.tolist()} outside 1..{self.num_classes - 1}: labels are "
                    "1-based as torchvision's (0 is background); add 1 to a dataset's 0-based class indices"
                )
            # Each object peaks (value 1) at the cell holding its centre, spreading as its box.
            centre = (boxes[:, :2] + boxes[:, 2:]) / 2 / STRIDE
            cell = centre.floor().clamp(0, s - 1)
            size = (boxes[:, 2:] - boxes[:, :2]).clamp(min=1.0) / STRIDE
            sigma = (self.gaussian_alpha * size / 6).clamp(min=0.35)
            gx = torch.exp(-((grid.view(1, s) - cell[:, :1]) ** 2) / (2 * sigma[:, :1] ** 2))  # (N, s)
            gy = torch.exp(-((grid.view(1, s) - cell[:, 1:]) ** 2) / (2 * sigma[:, 1:] ** 2))
            g = gy[:, :, None] * gx[:, None, :]  # (N, s, s)
            for n in range(len(boxes)):
                heat[i, labels[n] - 1] = torch.maximum(heat[i, labels[n] - 1], g[n])
            # Box regression where an object's Gaussian is high; a cell two objects share goes
            # to the smaller one (the larger has more cells to spare), as TTFNet does.
            area = size.prod(dim=1)
            region = g >= self.box_region
            region[torch.arange(len(boxes)), cell[:, 1].long(), cell[:, 0].long()] = True
            order = torch.argsort(area, descending=True)  # smaller objects written last win
            for n in order.tolist():
                cells = region[n]
                w_n = g[n] * cells
                box_t[i][cells] = boxes[n]
                weight[i][cells] = (w_n / w_n.sum())[cells]
        return heat, box_t, weight

    def loss(
        self, heat_logits: Tensor, reg: Tensor, targets: Sequence[Mapping[str, Tensor]], scales: Tensor
    ) -> dict[str, Tensor]:
        heat_t, box_t, weight = self.encode(targets, scales)
        num = max(1.0, float(sum(int(t["boxes"].reshape(-1, 4).shape[0]) for t in targets)))
        # Penalty-reduced focal loss (CenterNet), in log-sigmoid form for stability.
        pos = heat_t.eq(1.0).to(heat_logits.dtype)
        log_p, log_1p = F.logsigmoid(heat_logits), F.logsigmoid(-heat_logits)
        p = torch.sigmoid(heat_logits)
        pos_loss = -((1 - p) ** 2) * log_p * pos
        neg_loss = -((1 - heat_t) ** 4) * p**2 * log_1p * (1 - pos)
        loss_heat = (pos_loss.sum() + neg_loss.sum()) / num
        # GIoU on the boxes decoded at the weighted cells.
        pred = self._boxes_from_reg(reg)
        mask = weight > 0
        if bool(mask.any()):
            giou = generalized_box_iou_loss(pred[mask], box_t[mask], reduction="none")
            loss_box = (giou * weight[mask]).sum() / num
        else:
            loss_box = reg.sum() * 0.0  # keeps the graph (and DDP) whole on a background-only batch
        return {"loss_heatmap": loss_heat, "loss_box": self.box_loss_weight * loss_box}

    # -- torchvision's API ---------------------------------------------------------------------

    def forward(
        self, images: Sequence[Tensor], targets: Sequence[Mapping[str, Tensor]] | None = None
    ) -> dict[str, Tensor] | list[dict[str, Tensor]]:
        x, scales = self.transform(images)
        heat, reg = self.forward_raw(x)
        if self.training:
            if targets is None:
                raise ValueError("in training mode the model needs targets: model(images, targets)")
            if len(targets) != len(images):
                raise ValueError(f"{len(targets)} targets for {len(images)} images: one dict per image")
            return self.loss(heat, reg, targets, scales)
        boxes, scores, labels = self.decode(heat, reg)
        sizes = [(int(im.shape[1]), int(im.shape[2])) for im in images]
        return self.postprocess(boxes, scores, labels, scales, sizes)


def build_native_detector(num_classes: int, **kwargs: object) -> NativeDetector:
    """A `NativeDetector`; `num_classes` counts the background, as torchvision's do (the
    ten digits: 11). Keyword arguments go to `NativeDetector` (input_size, widths, neck,
    score_thresh, nms_thresh, topk, detections_per_img, ...)."""
    return NativeDetector(num_classes, **kwargs)  # type: ignore[arg-type]
