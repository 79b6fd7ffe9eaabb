"""What ``amp.initialize`` and ``amp.scale_loss`` accept as one optimizer.

Besides ``torch.optim.Optimizer`` instances, Apex accepted its ``LARC``: a plain object (not an
``Optimizer`` subclass) that wraps one optimizer as ``.optim`` and forwards ``param_groups``,
``state``, ``state_dict``, ``load_state_dict``, ``zero_grad`` and ``add_param_group`` to it. amp
patches such a wrapper itself, so its ``step`` (which adjusts the gradients, then steps the inner
optimizer) runs inside amp's skip logic. The check is by shape, not by class, so that both
``amp.parallel.LARC`` and NVIDIA Apex's own ``apex.parallel.LARC`` qualify.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Union

import torch

if TYPE_CHECKING:
    from typing_extensions import TypeGuard

__all__ = ["OptimizerLike", "OptimizerWrapper", "is_optimizer", "is_optimizer_wrapper"]

_FORWARDED = ("param_groups", "state", "state_dict", "load_state_dict", "zero_grad", "add_param_group",
              "step")


class OptimizerWrapper(Protocol):
    """A LARC-style wrapper, for type checkers: it holds the optimizer it steps as ``optim``."""

    optim: torch.optim.Optimizer
    param_groups: list[dict[str, Any]]

    def step(self) -> object: ...


#: What ``amp.initialize`` and ``amp.scale_loss`` take as one optimizer.
OptimizerLike = Union[torch.optim.Optimizer, OptimizerWrapper]


def is_optimizer_wrapper(obj: object) -> TypeGuard[OptimizerWrapper]:
    """Whether ``obj`` is a LARC-style wrapper around one ``torch.optim.Optimizer``."""
    if isinstance(obj, torch.optim.Optimizer) or isinstance(obj, type):
        return False
    return (isinstance(getattr(obj, "optim", None), torch.optim.Optimizer)
            and all(hasattr(obj, name) for name in _FORWARDED))


def is_optimizer(obj: object) -> TypeGuard[OptimizerLike]:
    """Whether amp can drive ``obj`` as one optimizer: a torch optimizer or a LARC-style wrapper."""
    return isinstance(obj, torch.optim.Optimizer) or is_optimizer_wrapper(obj)
