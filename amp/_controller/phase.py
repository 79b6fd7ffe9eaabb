"""Where an optimizer stands between two steps, and how the overflow flags of its backward passes combine."""
from __future__ import annotations

import enum
from typing import Sequence

import torch

__all__ = ["Phase", "combine_flags"]


class Phase(enum.Enum):
    """Where an optimizer stands between two steps (like GradScaler's ``OptState``)."""

    READY = "ready"  # no backward was unscaled since the last step
    IN_BACKWARD = "in backward"  # inside a scale_loss block
    GRADS_SCALED = "grads scaled"  # a delay_unscale block left the grads scaled
    UNSCALED = "unscaled"  # the grads are unscaled and wait for step()


def combine_flags(flags: Sequence[torch.Tensor]) -> torch.Tensor:
    """One overflow flag (device tensor) from the flags of several backward passes."""
    return flags[0] if len(flags) == 1 else torch.cat(list(flags)).amax(dim=0, keepdim=True)
