"""``FusedAdam``: Adam and AdamW in one ``multi_tensor_adam`` pass per kind of tensor (Apex's optimizer)."""
from __future__ import annotations

import math
from typing import Any, Callable, NoReturn

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

    The step count of each param group, ``param_groups[i]["step"]``, is a Python int as in Apex
    (LR schedulers read it): the steps applied so far. Parameters without a gradient are not
    updated and their state is untouched, but their group's count advances (Apex's rule; torch
    counts per parameter). A step that amp or GradScaler skips on the device (``found_inf``) writes
    nothing, and the host learns of the skip without waiting for the device: the count goes up
    when the step is taken and comes back down when the flag reaches the host, the step being
    skipped. On the CPU that is at once; on a GPU the flag is copied to the host behind the step's
    kernels and read when it is next needed, which only waits for that copy, never for later work:
    at the next ``step()``, ``state_dict()`` or ``amp.scale_loss`` exit (so an LR scheduler that
    reads the count after the backward, as NVIDIA's BERT scripts do, sees a skipped step uncounted,
    as under Apex). Only a read between a skipped GPU step and the next of these sees it counted;
    the Adam arithmetic never does. The step that creates a group's state under such a flag reads
    the flag on the host once, so that a skipped first step leaves no state behind.

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
        self._reset_step_bookkeeping()

    def _reset_step_bookkeeping(self) -> None:
        # The last step's skip flag on its way to the host, and the counts the running step set.
        self._pending_skip: _PendingSkip | None = None
        self._counted: list[tuple[dict[str, Any], int]] = []

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._reset_step_bookkeeping()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        self._settle_step_counts()
        self._counted = []
        result = super().step(closure)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and self._counted:
            self._pending_skip = _PendingSkip(found_inf, self._counted)
            if found_inf.device.type == "cpu":
                self._settle_step_counts()  # free on the CPU: the count is exact at once
        return result

    def _settle_step_counts(self) -> None:
        """Take back the counts of the last step if the device skipped it (see the class docstring)."""
        pending, self._pending_skip = self._pending_skip, None
        if pending is not None and pending.skipped():
            for group, counted in pending.groups:
                if group.get("step") == counted:  # unless something wrote another count since
                    group["step"] = counted - 1

    def state_dict(self) -> dict[str, Any]:
        """As torch's, with every count settled, and torch's per-parameter ``"step"`` (a CPU float32
        tensor) beside each parameter's state, so that ``torch.optim.Adam`` / ``AdamW`` load it."""
        self._settle_step_counts()
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:
            count = float(group.get("step", 0))
            for index in group["params"]:
                if index in state_dict["state"]:
                    state_dict["state"][index] = {**state_dict["state"][index],
                                                  "step": torch.tensor(count, dtype=torch.float32)}
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, for FusedAdam's, Apex's and torch's Adam / AdamW's state dicts (see the class
        docstring); everything is checked before anything is loaded."""
        self._settle_step_counts()
        super().load_state_dict(_as_fused_adam_state(state_dict))

    def __getstate__(self) -> dict[str, Any]:
        self._settle_step_counts()
        return super().__getstate__()

    def _step_group(self, group: dict[str, Any], buckets: dict[BucketKey, Bucket],
                    found_inf: torch.Tensor | None, inv_scale: Scalar, model_inv_scale: Scalar) -> None:
        fresh = [param for bucket in buckets.values() for param in bucket.params
                 if "exp_avg" not in self.state[param]]
        if fresh and found_inf is not None and found_inf.item():
            return  # a skipped step that would create state: nothing may change (the one host read)
        step = _step_count(group.get("step", 0)) + 1
        for param in fresh:
            state = self.state[param]
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        group["step"] = step
        self._counted.append((group, step))
        beta1, beta2 = group["betas"]
        for (device, _, _, _, from_model), bucket in buckets.items():
            states = [self.state[param] for param in bucket.params]
            lists = [bucket.grads, bucket.params, [state["exp_avg"] for state in states],
                     [state["exp_avg_sq"] for state in states]]
            if bucket.copies:
                lists.append(bucket.copies)
            multi_tensor_applier(multi_tensor_adam, self._noop_flag(device, found_inf), lists, group["lr"],
                                 beta1, beta2, group["eps"], step, int(self.adam_w_mode),
                                 int(group["bias_correction"]), group["weight_decay"],
                                 model_inv_scale if from_model else inv_scale)


class _PendingSkip:
    """A step's skip flag on its way to the host, and the counts that step set (group, count)."""

    def __init__(self, found_inf: torch.Tensor, groups: list[tuple[dict[str, Any], int]]) -> None:
        self.groups = groups
        flag = found_inf.detach().reshape(1).to(torch.float32)
        if flag.device.type == "cpu":
            self._host, self._copied = flag, None
        else:
            # Behind the step's kernels in the stream; waiting for it waits for nothing later.
            self._host = torch.empty(1, dtype=torch.float32, pin_memory=True)
            self._host.copy_(flag, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def skipped(self) -> bool:
        if self._copied is not None:
            self._copied.synchronize()
        # Through numpy: memory on the host, read without asking the device anything.
        return bool(self._host.numpy()[0] != 0)


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
        _check_step_count(group.get("step"), index)
        if group.get("step") is not None:
            group["step"] = _step_count(group["step"])
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
            _check_step_count(step, index)
            counts[param] = _step_count(step)
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"parameter {param}: {count}" for param, count in list(counts.items())[:4])
        raise ValueError(f"FusedAdam.load_state_dict: the parameters of param group {index} were stepped "
                         f"different numbers of times ({shown}, ...); FusedAdam keeps one count per "
                         "group. Put parameters with different counts in different param groups, or "
                         "continue with torch.optim.AdamW.")
    return next(iter(counts.values()), 0)


def _step_count(step: Any) -> int:
    """A count checked by ``_check_step_count`` (an int, a whole float or a 1-element tensor) as an int."""
    return int(step.item() if isinstance(step, torch.Tensor) else step)


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
