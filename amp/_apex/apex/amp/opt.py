"""``apex.amp.opt``: the optimizer wrapper of Apex's first amp API (``handle.wrap_optimizer``).

That API (``amp.init()``, ``handle.wrap_optimizer(optimizer)``, ``optimizer.scale_loss(loss)``)
was already retired in the Apex this mirrors, whose wrapper unscaled the parameters themselves
instead of their gradients. Its replacement is ``amp.initialize`` and ``amp.scale_loss``, which
do per loss what it did (dynamic loss scalers, skipped steps).
"""
from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["OptimWrapper"]


class OptimWrapper:
    """Refuses to be made, with the calls that replace it."""

    def __init__(self, optimizer: Any, amp_handle: Any, num_loss: int) -> None:
        _refuse()


def _refuse() -> NoReturn:
    raise RuntimeError(
        "apex.amp.opt.OptimWrapper belongs to Apex's retired first amp API (amp.init() + "
        "handle.wrap_optimizer). Use `model, optimizer = amp.initialize(model, optimizer, "
        "opt_level=\"O1\", num_losses=N)` and, per loss, `with amp.scale_loss(loss, optimizer, "
        "loss_id=i) as scaled_loss: scaled_loss.backward()`, then `optimizer.step()`.")
