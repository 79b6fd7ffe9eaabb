"""Where an optimizer stands between two steps, what it may do there, and how the overflow flags of its
backward passes combine."""
from __future__ import annotations

import enum
from typing import Sequence

import torch

__all__ = ["Phase", "check_phase_for_step", "combine_flags"]


class Phase(enum.Enum):
    """Where an optimizer stands between two steps (like GradScaler's ``OptState``)."""

    READY = "ready"  # no backward was unscaled since the last step
    IN_BACKWARD = "in backward"  # inside a scale_loss block
    GRADS_SCALED = "grads scaled"  # a delay_unscale block left the grads scaled
    UNSCALED = "unscaled"  # the grads are unscaled and wait for step()


def combine_flags(flags: Sequence[torch.Tensor]) -> torch.Tensor:
    """One overflow flag (device tensor) from the flags of several backward passes."""
    return flags[0] if len(flags) == 1 else torch.cat(list(flags)).amax(dim=0, keepdim=True)


def check_phase_for_step(phase: Phase) -> None:
    """Raise if ``optimizer.step()`` comes in ``phase``, before the gradients are unscaled."""
    if phase is Phase.IN_BACKWARD:
        raise RuntimeError("optimizer.step() was called inside its amp.scale_loss block: the "
                           "gradients are unscaled when the block exits. Call step() after the "
                           "`with` block.")
    if phase is Phase.GRADS_SCALED:
        raise RuntimeError("optimizer.step() was called while the gradients are still scaled: the "
                           "last amp.scale_loss block used delay_unscale=True and no block without "
                           "it followed. Run the last backward of the step in a scale_loss block "
                           "with delay_unscale=False (it unscales everything), then call step().")
