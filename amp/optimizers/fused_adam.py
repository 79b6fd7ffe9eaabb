"""``FusedAdam``: Adam and AdamW in one ``multi_tensor_adam`` pass per kind of tensor (Apex's optimizer)."""
from __future__ import annotations

import math
from typing import Any, NoReturn

import torch

from amp.multi_tensor_apply import Scalar, multi_tensor_adam, multi_tensor_applier

from ._fused import Bucket, BucketKey, FusedOptimizer, Params, check_real

__all__ = ["FusedAdam"]

# The step numbers multi_tensor_adam takes end at 2**31 - 1: a count of steps taken, one less.
_MAX_STEP_COUNT = 2**31 - 2


def _refuse(option: str, advice: str) -> NoReturn:
    raise ValueError(f"FusedAdam({option}) is not offered: {advice}")


class FusedAdam(FusedOptimizer):
    """Adam (``adam_w_mode=False``: L2 weight decay added to the gradient) or AdamW (the default:
    decoupled weight decay) whose update is one fused pass.

    The arithmetic is ``torch.optim.Adam``'s / ``AdamW``'s, in fp32 for every parameter dtype. It is
    an ordinary ``torch.optim.Optimizer``::

        optimizer = amp.optimizers.FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)

    Under ``amp.initialize`` at O2/O5 amp unscales every backward into fp32 master gradients, as
    for any optimizer (and as Apex did: a list of ``amp.master_params(optimizer)`` kept across steps
    sees them), and the same pass that updates the fp32 master and its state writes the rounded
    master into the model parameter: no separate master->model copy runs.
    ``materialize_master_grads=False`` goes further: the pass reads the model's fp16/bf16 gradients
    and divides the loss scale out itself, and no fp32 master gradients are made (a sixth fewer bytes
    moved after backward, 4 fewer bytes per parameter held). Iterating ``amp.master_params(optimizer)``
    between ``scale_loss`` and ``step`` (to clip) then makes them for that step; a master reached
    otherwise (a list kept from an earlier step) holds a gradient that raises if it is read.

    Args:
        params: parameters or param groups (float32, float16 or bfloat16; dense gradients).
        lr (float, default 1e-3), betas (tuple, default (0.9, 0.999)), eps (float, default 1e-8),
        weight_decay (float, default 0).
        bias_correction (bool, default True): divide the moments by ``1 - beta ** step``.
        adam_w_mode (bool, default True): decoupled weight decay (AdamW); False: L2 (Adam).
        amsgrad, capturable, master_weights: accepted as Apex's arguments; only ``False`` is offered.
        set_grad_none (bool, default True): what ``zero_grad()`` does without ``set_to_none``.
        materialize_master_grads (bool, keyword-only, default True): see above; read once, by
            ``amp.initialize``.

    The step count of each param group (``param_groups[i]["step"]``, a device tensor) counts its
    steps, applied ones only: a step that amp or GradScaler skips (``found_inf``) writes nothing
    and leaves it unchanged without a host read. Parameters without a gradient are not updated and
    their state is untouched, but their group's count advances (Apex's rule; torch counts per
    parameter). The step that creates a group's state under such a flag reads the flag on the
    host once, so that a skipped first step leaves no state behind. ``load_state_dict`` refuses a
    count that is not a whole number from 0 to 2**31 - 2 (``multi_tensor_adam``'s step range).
    """

    def __init__(self, params: Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 capturable: bool = False, master_weights: bool = False, *,
                 materialize_master_grads: bool = True) -> None:
        if amsgrad:
            _refuse("amsgrad=True", "use torch.optim.Adam(amsgrad=True) or torch.optim.AdamW(amsgrad=True); "
                    "amp.initialize accepts them at every opt level.")
        if capturable:
            _refuse("capturable=True", "this step already keeps its step count on the device and reads no "
                    "host value, but it is not validated under CUDA graph capture. Leave capturable=False, "
                    "or capture torch.optim.AdamW(capturable=True).")
        if master_weights:
            _refuse("master_weights=True", "use amp.initialize(model, optimizer, opt_level='O2') (or 'O5' "
                    "for bfloat16), which keeps the fp32 master weights; FusedAdam then steps them and "
                    "writes the low-precision model copy in the same pass.")
        check_real("learning rate", lr, 0.0)
        check_real("epsilon value", eps, 0.0)
        check_real("weight_decay value", weight_decay, 0.0)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"Invalid betas: {betas!r}; expected a pair of numbers in [0, 1).")
        check_real("beta parameter at index 0", betas[0], 0.0, 1.0, high_open=True)
        check_real("beta parameter at index 1", betas[1], 0.0, 1.0, high_open=True)
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults, materialize_master_grads, set_grad_none)
        self.adam_w_mode = bool(adam_w_mode)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, refusing (before it loads anything) a param group's step count that the
        kernel could not take: on a GPU a step out of range would skip every step silently."""
        for index, group in enumerate(state_dict.get("param_groups", ())):
            _check_step_count(group.get("step"), index)
        super().load_state_dict(state_dict)

    def _step_group(self, group: dict[str, Any], buckets: dict[BucketKey, Bucket],
                    found_inf: torch.Tensor | None, inv_scale: Scalar, model_inv_scale: Scalar) -> None:
        fresh = [param for bucket in buckets.values() for param in bucket.params
                 if "exp_avg" not in self.state[param]]
        if fresh and found_inf is not None and found_inf.item():
            return  # a skipped step that would create state: nothing may change (the one host read)
        for param in fresh:
            state = self.state[param]
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        step = _group_step(group, next(iter(buckets))[0])
        step.add_(1)
        beta1, beta2 = group["betas"]
        for (device, _, _, _, from_model), bucket in buckets.items():
            states = [self.state[param] for param in bucket.params]
            lists = [bucket.grads, bucket.params, [state["exp_avg"] for state in states],
                     [state["exp_avg_sq"] for state in states]]
            if bucket.copies:
                lists.append(bucket.copies)
            multi_tensor_applier(multi_tensor_adam, self._noop_flag(device, found_inf), lists, group["lr"],
                                 beta1, beta2, group["eps"], step.to(device), int(self.adam_w_mode),
                                 int(group["bias_correction"]), group["weight_decay"],
                                 model_inv_scale if from_model else inv_scale)
        if found_inf is not None:
            step.sub_(found_inf.detach().reshape(1).to(step.device, torch.float32))


def _check_step_count(step: Any, index: int) -> None:
    """A loaded step count (the steps taken so far: a number, or a 1-element tensor, read once
    here) must be a whole number from 0 to 2**31 - 2, so that the next step number is one that
    ``multi_tensor_adam`` takes."""
    if step is None:
        return
    value = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value == math.floor(value) and 0 <= value <= _MAX_STEP_COUNT):
        raise ValueError(f"FusedAdam.load_state_dict: param group {index} has the step count {step!r}; "
                         f"a step count is a whole number from 0 to {_MAX_STEP_COUNT} (the steps taken)")


def _group_step(group: dict[str, Any], device: torch.device) -> torch.Tensor:
    """The group's step count, a 1-element fp32 tensor on ``device`` (made, or moved there, once).

    A checkpoint of Apex's FusedAdam holds a Python int; one loaded elsewhere, a tensor on another
    device.
    """
    step = group.get("step")
    if not isinstance(step, torch.Tensor):
        step = torch.full((1,), float(step or 0), dtype=torch.float32, device=device)
    elif step.device != device or step.dtype != torch.float32 or step.shape != (1,):
        step = step.detach().to(device=device, dtype=torch.float32).reshape(1)
    group["step"] = step
    return step
