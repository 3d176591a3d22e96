"""Capture and restore every RNG the training process draws from.

Stored as tensors and plain tuples only, so checkpoints load with `weights_only=True`.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def capture(cuda: bool = False) -> dict[str, Any]:
    """Every RNG state; the CUDA ones only when training on CUDA (asking for them would
    initialise CUDA in a CPU run on a GPU machine)."""
    np_state: tuple[Any, ...] = np.random.get_state(legacy=True)  # type: ignore[assignment]
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64).copy()),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
    }
    if cuda:
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            log.warning(
                "the checkpoint holds RNG states for %d GPU(s), this machine has %d: CUDA RNG streams "
                "start afresh, so this resumption is not bitwise reproducible",
                len(cuda_states),
                torch.cuda.device_count(),
            )


def _as_tuple(obj: Any) -> Any:
    # random.setstate needs tuples, and some serialisers hand back lists.
    if isinstance(obj, list | tuple):
        return tuple(_as_tuple(x) for x in obj)
    return obj
