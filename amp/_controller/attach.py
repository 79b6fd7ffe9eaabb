"""Giving an optimizer its controller at ``amp.initialize``: ``_amp_stash``, a wrapped ``step``, its masters.

``step`` is wrapped exactly once, here, and calls the controller's; ``add_param_group`` (and under
master weights ``zero_grad``) go to the controller too. Masters are made now (Apex made them
lazily), so that checkpoints loaded right after ``initialize`` land on the fp32 masters with no
precision lost.
"""
from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING, Any, Callable

import torch

from .._apex_compat import attach_apex_methods
from .._compat import LR_SCHEDULER_STEP_MARKS, eager_under_compile
from ..options import REMAINDER
from .controller import OptimizerController
from .weights import MasterWeights, OwnWeights, Weights

if TYPE_CHECKING:
    from .._run import AmpContext

__all__ = ["attach_controller"]


def _amp_step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    """``optimizer.step`` after initialize: the controller's step."""
    return optimizer._amp_stash.step(*args, **kwargs)


@eager_under_compile
def _amp_zero_grad(optimizer: Any, set_to_none: bool = True) -> None:
    """``optimizer.zero_grad`` under master weights: the model's grads and the masters'.

    Run as it is under ``torch.compile``, as torch's own ``zero_grad``.
    """
    stash = optimizer._amp_stash
    stash.weights.zero_grad(set_to_none)
    stash.grads_at_exit.forget()


def attach_controller(optimizer: Any, context: AmpContext, param_names: dict[torch.Tensor, str],
                      fp32_values: dict[int, torch.Tensor], max_consecutive_skips: int) -> None:
    """Give ``optimizer`` its controller (``_amp_stash``) and delegating methods, once, and its masters.

    ``amp.initialize`` has checked the optimizer already (``_apex_compat.APEX_METHODS``).
    """
    names = dict(param_names)
    weights: Weights
    copy_masters_to_model: Callable[[], None] | None = None
    if context.options.master_weights and not context.sharded_masters:
        # amp.optimizers name their own kind of master weights, so amp never imports them.
        remainders = context.options.master_weights == REMAINDER
        masters = getattr(optimizer, "_amp_master_weights_kind", MasterWeights)(optimizer, names, remainders)
        optimizer.zero_grad = types.MethodType(_amp_zero_grad, optimizer)
        copy_masters_to_model = masters.copy_to_model
        weights = masters
    else:
        weights = OwnWeights(optimizer, names)
    controller = OptimizerController(optimizer, context, names, max_consecutive_skips, weights)
    optimizer._amp_stash = controller
    attach_apex_methods(optimizer, weights.set_grads_aside, controller.unscale_grads, copy_masters_to_model)
    optimizer.add_param_group = controller.add_param_group
    step = _amp_step
    marks = [mark for mark in LR_SCHEDULER_STEP_MARKS if hasattr(controller.original_step, mark)]
    if marks:
        # An LR scheduler created before initialize warns at its first step() unless it finds its
        # mark on optimizer.step; the mark goes on a per-optimizer copy, never on _amp_step itself.
        @functools.wraps(_amp_step)
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            return _amp_step(self, *args, **kwargs)
        for mark in marks:
            setattr(step, mark, True)
    # Bound to the optimizer itself: an LR scheduler created later rebinds step's function to it.
    optimizer.step = types.MethodType(step, optimizer)
    controller.lazy_init(fp32_values)

