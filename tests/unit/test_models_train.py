"""small_cnn is the demo's model: it must learn scikit-learn digits, fast, on a CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from visionloop.models import create_model, model_defaults


def _digits_32px() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1,797 8×8 digits, upsampled to 32×32 RGB and normalised as small_cnn expects."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    d = model_defaults("small_cnn")
    mean = torch.tensor(d.mean).view(1, 3, 1, 1)
    std = torch.tensor(d.std).view(1, 3, 1, 1)
    return (x - mean) / std, torch.tensor(digits.target)


def test_small_cnn_reaches_97_percent_on_digits() -> None:
    # Two epochs, batch 32, one-cycle AdamW: ~99% with this seed (98.9-99.7% over seeds 0-3),
    # in ~13 CPU-seconds (~7 s wall on two free cores).
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x, y = _digits_32px()
    order = torch.randperm(len(y), generator=gen)
    train, val = order[:1437], order[1437:]

    model = create_model("small_cnn", 10)
    epochs, batch = 2, 32
    steps = epochs * -(-len(train) // batch)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-3, total_steps=steps, pct_start=0.25)
    model.train()
    for _ in range(epochs):
        shuffled = train[torch.randperm(len(train), generator=gen)]
        for i in range(0, len(shuffled), batch):
            idx = shuffled[i : i + batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()

    model.eval()
    with torch.no_grad():
        accuracy = (model(x[val]).argmax(dim=1) == y[val]).float().mean().item()
    assert accuracy >= 0.97, f"val accuracy {accuracy:.3f}"
