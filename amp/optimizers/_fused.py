"""What amp's fused optimizers share: validation, one op call per kind of tensor, amp's inputs.

A step groups the parameters of each param group by device and dtypes, so that one
``multi_tensor_*`` call serves each combination, and reads no host value: the overflow flag and
the inverse loss scale reach the op as device tensors.

Two callers hand a step more than the parameters' ``.grad``:

* ``torch.amp.GradScaler`` and ``amp`` (``_step_supports_amp_scaling``) set ``found_inf`` (a
  device flag: where it is nonzero the op writes nothing) and ``grad_scale`` (the grads still carry
  this scale; the op divides it out), as for torch's own fused optimizers.
* ``amp`` under master weights (O2/O5) sets ``_amp_model_copies`` (master -> low-precision model
  param): the op then writes the rounded master into the model param itself, and, with
  ``_amp_grads_from_model`` (set by amp per step: ``materialize_master_grads=False`` and no one read
  ``amp.master_params``' grads), reads the model param's low-precision grad, which carries
  ``most_recent_scale``, instead of an fp32 master grad. It reads only grads that a backward left
  since the last step or ``zero_grad`` (``scale_set_by_backward``): a step consumes them, and a
  master without this step's grad is not updated, so that a second ``step()`` with no backward in
  between changes no master, as with fp32 master grads, which every step clears.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple, Union

import torch

from amp._compat import eager_under_compile
from amp._remainder_master import RemainderMaster
from amp._controller.fused import FusedMasterWeights, inverse
from amp.multi_tensor_apply import Scalar

__all__ = ["FusedOptimizer"]

_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: What ``torch.optim.Optimizer`` takes as ``params``: tensors, or param groups (dicts).
Params = Union[Iterable[torch.Tensor], Iterable[Dict[str, Any]]]
#: A bucket's key: (device, grad dtype, param dtype, model-copy dtype or None, reads the model grad,
#: steps remainders).
BucketKey = Tuple[torch.device, torch.dtype, torch.dtype, Optional[torch.dtype], bool, bool]


def check_real(name: str, value: Any, low: float, high: float = float("inf"),
               high_open: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a real number in ``[low, high]`` (``[low, high)``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and low <= value and (value < high if high_open else value <= high)
    if not ok:
        upper = f"{high})" if high_open else f"{high}]"
        raise ValueError(f"Invalid {name}: {value!r}; expected a number in [{low}, {upper}.")


class Bucket:
    """The tensors of one op call: one device, one grad dtype, one param dtype, one copy dtype.

    Under ``master_weights="remainder"`` the params are ``RemainderMaster``s, the copies their bf16
    weights, and ``remainders`` their remainders: the op steps those two in place of the master.
    """

    __slots__ = ("params", "grads", "copies", "remainders")

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.copies: list[torch.Tensor] = []
        self.remainders: list[torch.Tensor] = []

    def part(self, indices: Sequence[int]) -> Bucket:
        """The bucket of the tensors at ``indices`` (this one if they are all of them)."""
        if len(indices) == len(self.params):
            return self
        part = Bucket()
        part.params = [self.params[i] for i in indices]
        part.grads = [self.grads[i] for i in indices]
        part.copies = [self.copies[i] for i in indices] if self.copies else []
        part.remainders = [self.remainders[i] for i in indices] if self.remainders else []
        return part

    def op_lists(self, state: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """The op's lists: grads, params, ``state``, then the model copies if any; with remainders
        grads, bf16 weights, ``state``, remainders (the op rebuilds and steps the masters)."""
        if self.remainders:
            return [self.grads, self.copies, *state, self.remainders]
        return [self.grads, self.params, *state] + ([self.copies] if self.copies else [])


class FusedOptimizer(torch.optim.Optimizer):
    """Base of amp's fused optimizers (not public): subclasses implement ``_step_group``."""

    # torch.amp.GradScaler and amp pass found_inf / grad_scale as attributes, and the step honours them.
    _step_supports_amp_scaling = True
    # What amp.initialize steps for these optimizers under master weights (O2/O5).
    _amp_master_weights_kind = FusedMasterWeights

    def __init__(self, params: Params, defaults: dict[str, Any], materialize_master_grads: bool,
                 set_grad_none: bool) -> None:
        super().__init__(params, defaults)
        self._noop_flags: dict[torch.device, torch.Tensor] = {}
        self.materialize_master_grads = bool(materialize_master_grads)
        self.set_grad_none = bool(set_grad_none)
        # Apex's fields, written by amp (O2/O5, materialize_master_grads=False): the scale that the
        # model's low-precision grads carry, and whether a backward set it since the last step.
        self.most_recent_scale: Scalar = 1.0
        self.scale_set_by_backward = False

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the gradients; ``set_to_none`` defaults to the ``set_grad_none`` given at construction."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, refusing parameters of a dtype the kernels do not step."""
        params = param_group["params"] if isinstance(param_group, dict) else None
        params = [params] if isinstance(params, torch.Tensor) else params
        if isinstance(params, (list, tuple)):
            for index, param in enumerate(params):
                if isinstance(param, torch.Tensor) and param.dtype not in _PARAM_DTYPES:
                    raise TypeError(
                        f"{type(self).__name__} steps float32, float16 and bfloat16 parameters; parameter "
                        f"{index} of the group (shape {tuple(param.shape)}) is {param.dtype}. Use the "
                        "torch.optim optimizer for it, in a second optimizer.")
        super().add_param_group(param_group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._noop_flags = {}

    @eager_under_compile  # the ops are amp's kernels (or their exact PyTorch twins): nothing to compile
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        grad_scale = getattr(self, "grad_scale", None)
        copies = getattr(self, "_amp_model_copies", None) or {}
        from_model = getattr(self, "_amp_grads_from_model", False)
        # Everything is checked before the first op writes anything.
        plans = [self._buckets(group, copies, from_model, self.scale_set_by_backward)
                 for group in self.param_groups]
        inv_scale = 1.0 if grad_scale is None else inverse(grad_scale)
        model_inv_scale = inverse(self.most_recent_scale) if from_model else inv_scale
        if from_model and grad_scale is not None:
            raise RuntimeError(f"{type(self).__name__}.step got a grad_scale while amp left the model's "
                               "gradients scaled by its own loss scale; use amp or GradScaler, not both.")
        self._step_groups(plans, found_inf, inv_scale, model_inv_scale)
        return loss

    def _step_groups(self, plans: list[dict[BucketKey, Bucket]], found_inf: torch.Tensor | None,
                     inv_scale: Scalar, model_inv_scale: Scalar) -> None:
        """Step every param group with its buckets (``plans``, one per group)."""
        for group, buckets in zip(self.param_groups, plans):
            if buckets:
                self._step_group(group, buckets, found_inf, inv_scale, model_inv_scale)

    def _step_group(self, group: dict[str, Any], buckets: dict[BucketKey, Bucket],
                    found_inf: torch.Tensor | None, inv_scale: Scalar, model_inv_scale: Scalar) -> None:
        """One op call per bucket of ``group`` (what the subclass's optimizer does)."""
        raise NotImplementedError

    def _buckets(self, group: dict[str, Any], copies: dict[torch.Tensor, torch.Tensor],
                 from_model: bool, model_grads_fresh: bool) -> dict[BucketKey, Bucket]:
        """``{(device, grad dtype, param dtype, copy dtype or None, reads the model grad): Bucket}``.

        With ``from_model`` a param with a model copy takes the copy's grad if ``model_grads_fresh``
        (a backward left it since the last step), else none.
        """
        buckets: dict[BucketKey, Bucket] = {}
        for param in group["params"]:
            copy = copies.get(param)
            if from_model and copy is not None:
                grad = copy.grad if model_grads_fresh else None
            else:
                grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients (a parameter of shape "
                    f"{tuple(param.shape)} has one, e.g. from nn.Embedding(sparse=True)). Use dense "
                    "gradients, or a torch.optim optimizer that accepts sparse ones (SparseAdam, SGD) "
                    "for those parameters.")
            remainders = param.remainders if isinstance(param, RemainderMaster) and copy is not None else None
            key = (param.device, grad.dtype, param.dtype, None if copy is None else copy.dtype,
                   from_model and copy is not None, remainders is not None)
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = Bucket()
            bucket.params.append(param)
            bucket.grads.append(grad)
            if copy is not None:
                bucket.copies.append(copy)
            if remainders is not None:
                bucket.remainders.append(remainders)
        return buckets

    def _noop_flag(self, device: torch.device, found_inf: torch.Tensor | None) -> torch.Tensor:
        """The op's skip flag on ``device``: ``found_inf`` itself, else a zero kept per device."""
        if found_inf is not None:
            return found_inf.detach().reshape(1).to(device=device, dtype=torch.float32)
        flag = self._noop_flags.get(device)
        if flag is None:
            flag = self._noop_flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return flag
