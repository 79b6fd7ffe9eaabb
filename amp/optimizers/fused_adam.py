"""``FusedAdam``: Adam and AdamW in one ``multi_tensor_adam`` pass per kind of tensor (Apex's optimizer)."""
from __future__ import annotations

from typing import Any, NoReturn

import torch

from amp.multi_tensor_apply import Scalar, multi_tensor_adam, multi_tensor_applier

from ._fused import Bucket, BucketKey, Params
from ._group_steps import (MomentsOptimizer, check_moment_options, check_step_count, moment_lists,
                           step_count)

__all__ = ["FusedAdam"]


def _refuse(option: str, advice: str) -> NoReturn:
    raise ValueError(f"FusedAdam({option}) is not offered: {advice}")


class FusedAdam(MomentsOptimizer):
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

    The step count of each param group, ``param_groups[i]["step"]``, is a Python int as in Apex (LR
    schedulers read it); a step skipped on the device comes off it once the host learns of it
    (``amp.optimizers._group_steps`` says when).

    State dicts translate to and from ``torch.optim.Adam`` / ``AdamW``'s (the same arithmetic):
    ``state_dict()`` also gives every parameter with state torch's own ``"step"``, and
    ``load_state_dict`` takes torch's (one count per group, from the per-parameter counts) as well
    as Apex's and its own; what FusedAdam cannot continue (``amsgrad``, ``maximize``, parameters
    of one group stepped different numbers of times) is refused before anything changes, as is a
    count that is not a whole number from 0 to 2**31 - 2 (``multi_tensor_adam``'s step range).
    Which of L2 and decoupled weight decay applies is this optimizer's ``adam_w_mode``, as torch's
    class decides for its own state dicts; ``bias_correction=False`` has no torch counterpart.
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
        check_moment_options(lr, eps, weight_decay, betas)
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults, materialize_master_grads, set_grad_none)
        self.adam_w_mode = bool(adam_w_mode)

    def state_dict(self) -> dict[str, Any]:
        """As torch's, with every count settled, and torch's per-parameter ``"step"`` (a CPU float32
        tensor) beside each parameter's state, so that ``torch.optim.Adam`` / ``AdamW`` load it."""
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:
            count = float(group.get("step", 0))
            for index in group["params"]:
                if index in state_dict["state"]:
                    state_dict["state"][index] = {**state_dict["state"][index],
                                                  "step": torch.tensor(count, dtype=torch.float32)}
        return state_dict

    def _checked_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """FusedAdam's, Apex's and torch's Adam / AdamW's state dicts (see the class docstring);
        everything is checked before anything is loaded."""
        return _as_fused_adam_state(state_dict)

    def _step_group(self, group: dict[str, Any], buckets: dict[BucketKey, Bucket],
                    found_inf: torch.Tensor | None, inv_scale: Scalar, model_inv_scale: Scalar) -> None:
        step = self._begin_group_step(group, buckets, found_inf)
        if step is None:
            return
        beta1, beta2 = group["betas"]
        for (device, _, _, _, from_model, _), bucket in buckets.items():
            lists = moment_lists(self.state, bucket)
            multi_tensor_applier(multi_tensor_adam, self._noop_flag(device, found_inf), lists, group["lr"],
                                 beta1, beta2, group["eps"], step, int(self.adam_w_mode),
                                 int(group["bias_correction"]), group["weight_decay"],
                                 model_inv_scale if from_model else inv_scale)


# torch.optim.Adam / AdamW's group options that FusedAdam has no use for once they are checked.
_TORCH_ONLY_OPTIONS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused",
                       "decoupled_weight_decay")


def _as_fused_adam_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` in FusedAdam's form, checked (a new dict: the caller's is not changed).

    FusedAdam's and Apex's groups carry ``bias_correction`` and one ``step``; torch's carry neither
    and count per parameter. Per-parameter counts (torch's, or the copies ``state_dict`` adds) are
    dropped from the state once the group's count is known.
    """
    groups = state_dict.get("param_groups", ())
    states = state_dict.get("state", {})
    translated = []
    for index, group in enumerate(groups):
        group = dict(group)
        if "bias_correction" not in group:  # torch's Adam / AdamW
            for option in ("amsgrad", "maximize"):
                if group.get(option):
                    raise ValueError(f"FusedAdam.load_state_dict: param group {index} was saved with "
                                     f"{option}=True, which FusedAdam does not offer; continue it with "
                                     f"torch.optim.AdamW({option}=True) (amp.initialize takes it too).")
            for option in _TORCH_ONLY_OPTIONS:
                group.pop(option, None)
            group["bias_correction"] = True
            group["step"] = _torch_group_count(index, group, states)
        check_step_count("FusedAdam", group.get("step"), index)
        if group.get("step") is not None:
            group["step"] = step_count(group["step"])
        translated.append(group)
    state = {key: {name: value for name, value in param_state.items() if name != "step"}
             if isinstance(param_state, dict) else param_state for key, param_state in states.items()}
    return {**state_dict, "state": state, "param_groups": translated}


def _torch_group_count(index: int, group: dict[str, Any], states: dict[Any, Any]) -> int:
    """The one count of a torch param group: its parameters' counts, which must agree."""
    counts = {}
    for param in group.get("params", ()):
        step = states.get(param, {}).get("step") if isinstance(states.get(param), dict) else None
        if step is not None:
            check_step_count("FusedAdam", step, index)
            counts[param] = step_count(step)
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"parameter {param}: {count}" for param, count in list(counts.items())[:4])
        raise ValueError(f"FusedAdam.load_state_dict: the parameters of param group {index} were stepped "
                         f"different numbers of times ({shown}, ...); FusedAdam keeps one count per "
                         "group. Put parameters with different counts in different param groups, or "
                         "continue with torch.optim.AdamW.")
    return next(iter(counts.values()), 0)
