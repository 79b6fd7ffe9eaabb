"""``apex.amp._process_optimizer``: Apex's per-optimizer amp functions, on the methods and the
controller (``optimizer._amp_stash``) that ``amp.initialize`` gives each optimizer.

Apex bound one of two sets of these functions to an optimizer, with or without master weights;
amp's controller knows which applies, so each pair calls the same method. They take an optimizer
returned by ``amp.initialize``; ``_process_optimizer`` itself is ``amp.initialize``'s work.
"""
from __future__ import annotations

from typing import Any, Iterable, NoReturn, Sequence

import torch

from amp._controller.controller import OptimizerController
from amp.scaler import LossScaler

__all__ = ["AmpOptimizerState", "lazy_init_with_master_weights", "lazy_init_no_master_weights",
           "prepare_backward_with_master_weights", "prepare_backward_no_master_weights",
           "post_backward_with_master_weights", "post_backward_no_master_weights",
           "prepare_backward_with_master_weights_FusedSGD", "prepare_backward_no_master_weights_FusedSGD",
           "post_backward_with_master_weights_FusedSGD", "post_backward_no_master_weights_FusedSGD",
           "post_backward_models_are_masters"]

#: What ``optimizer._amp_stash`` is (Apex's was an empty attribute holder).
AmpOptimizerState = OptimizerController


def _amp_method(optimizer: Any, name: str) -> Any:
    method = getattr(optimizer, name, None)
    if method is None or getattr(optimizer, "_amp_stash", None) is None:
        raise RuntimeError(f"{name} belongs to an optimizer returned by amp.initialize; pass this "
                           "optimizer through amp.initialize first.")
    return method


def lazy_init_with_master_weights(self: Any) -> None:
    """Build the optimizer's param lists and fp32 masters (``amp.initialize`` has built them)."""
    _amp_method(self, "_lazy_init_maybe_master_weights")()


lazy_init_no_master_weights = lazy_init_with_master_weights


def _amp_lazy_init(self: Any) -> None:
    _amp_method(self, "_amp_lazy_init")()


def _master_params_to_model_params(self: Any) -> None:
    _amp_method(self, "_master_params_to_model_params")()


def prepare_backward_with_master_weights(self: Any) -> None:
    """Before a backward: set aside the grads accumulated so far (``amp.scale_loss`` does this)."""
    _amp_method(self, "_prepare_amp_backward")()


prepare_backward_no_master_weights = prepare_backward_with_master_weights
prepare_backward_with_master_weights_FusedSGD = prepare_backward_with_master_weights
prepare_backward_no_master_weights_FusedSGD = prepare_backward_with_master_weights


def post_backward_with_master_weights(self: Any, scaler: LossScaler) -> None:
    """After a backward: unscale its grads with ``scaler`` and add back those set aside."""
    _amp_method(self, "_post_amp_backward")(scaler)


post_backward_no_master_weights = post_backward_with_master_weights
post_backward_with_master_weights_FusedSGD = post_backward_with_master_weights
post_backward_no_master_weights_FusedSGD = post_backward_with_master_weights


def post_backward_models_are_masters(scaler: LossScaler, params: Iterable[torch.Tensor],
                                     stashed_grads: list[torch.Tensor | None],
                                     scale_override: Sequence[float] | None = None) -> None:
    """Unscale the grads of ``params`` (their own masters) in place and add the ``stashed_grads``
    set aside before the backward, then empty the stash.

    ``scale_override`` is ``(grads_have_scale, stashed_have_scale, out_scale)``, by default
    ``(scale, 1, 1)``: ``grad = grad * out_scale / grads_have_scale + stashed * out_scale / stashed_have_scale``.
    """
    grads_have_scale, stashed_have_scale, out_scale = scale_override or (scaler.loss_scale(), 1.0, 1.0)
    fresh, with_stash, stashed = [], [], []
    for param, stash in zip(params, stashed_grads):
        if param.grad is None:
            param.grad = stash
        elif stash is None:
            fresh.append(param.grad)
        else:
            with_stash.append(param.grad)
            stashed.append(stash)
    if fresh:
        scaler.unscale_into(fresh, fresh, models_are_masters=True, scale_override=grads_have_scale / out_scale)
    if with_stash:
        scaler.unscale_with_stashed(with_stash, stashed, with_stash,
                                    scale_override=(grads_have_scale, stashed_have_scale, out_scale))
    stashed_grads[:] = [None] * len(stashed_grads)


def _process_optimizer(optimizer: Any, properties: Any) -> NoReturn:
    raise RuntimeError("apex.amp._process_optimizer is amp.initialize's work: call "
                       "`model, optimizer = amp.initialize(model, optimizer, opt_level=...)`.")
