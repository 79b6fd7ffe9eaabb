"""``FusedLAMB``: LAMB in one ``multi_tensor_lamb`` call per kind of tensor (Apex's optimizer)."""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from amp._compat import foreach_norm
from amp._pytorch_ops import remainder
from amp.multi_tensor_apply import Scalar, multi_tensor_applier, multi_tensor_lamb

from ._fused import Bucket, BucketKey, Params, check_real
from ._group_steps import MomentsOptimizer, check_moment_options, moment_lists

__all__ = ["FusedLAMB"]


class FusedLAMB(MomentsOptimizer):
    """LAMB (You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76
    minutes"): Adam's moments, and a step per tensor scaled by the trust ratio ``norm(param) /
    norm(update)``, after clipping the gradients by their global norm. NVIDIA's BERT pretraining
    trains with it under amp O2. An ordinary ``torch.optim.Optimizer``::

        optimizer = amp.optimizers.FusedLAMB(model.parameters(), lr=6e-3, weight_decay=0.01)

    The arithmetic is Apex's ``multi_tensor_lamb``, in fp32 for every parameter dtype, every
    operation rounded on its own (``amp._pytorch_ops.multi_tensor_lamb`` spells it out): the
    gradients, unscaled, are divided by ``global_norm / max_grad_norm`` where the global norm of
    all of them exceeds ``max_grad_norm``; then Adam's moments and ``update = m_hat / (sqrt(v_hat)
    + eps)`` (plus ``weight_decay * p`` with ``adam_w_mode``, else the decay is added to the
    gradient); then ``p -= ratio * update`` with ``ratio = lr * norm(p) / norm(update)`` for the
    tensors with weight decay (every tensor with ``use_nvlamb``), ``lr`` where either norm is 0 or
    the tensor is not decayed. The global norm is taken over every parameter of every group with a
    gradient (Apex's), with ``max_grad_norm`` of the constructor for all groups; ``max_grad_norm=
    float("inf")`` turns the clipping off.

    Under ``amp.initialize`` at O2/O5 it steps the fp32 masters and writes the rounded master into
    the model parameter in the same call, as ``FusedAdam`` does; ``materialize_master_grads=False``
    reads the model's low-precision gradients instead of fp32 master gradients (the global norm
    then is their norm times the inverse loss scale).

    Args:
        params: parameters or param groups (float32, float16 or bfloat16; dense gradients).
        lr (float, default 1e-3), betas (tuple, default (0.9, 0.999)), eps (float, default 1e-6),
        weight_decay (float, default 0.01): Apex's defaults.
        bias_correction (bool, default True): divide the moments by ``1 - beta ** step``.
        adam_w_mode (bool, default True): decoupled weight decay; False: L2 (added to the gradient).
        grad_averaging (bool, default True): ``m = beta1 * m + (1 - beta1) * g``; False: ``+ g``.
        max_grad_norm (float, default 1.0): the global gradient norm is clipped to it (> 0).
        use_nvlamb (bool, default False): the trust ratio for undecayed tensors too (NVLAMB).
        set_grad_none (bool, default True): what ``zero_grad()`` does without ``set_to_none``.
        amsgrad: accepted as Apex's argument; only ``False`` is offered.
        materialize_master_grads (bool, keyword-only, default True): see above; read once, by
            ``amp.initialize``.

    The step count of each param group is a Python int, as ``FusedAdam``'s (see
    ``amp.optimizers._group_steps``). Each call needs a scratch of 4 bytes per element for the
    updates (Apex wrote them into the gradients instead).
    """

    def __init__(self, params: Params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 set_grad_none: bool = True, max_grad_norm: float = 1.0, use_nvlamb: bool = False, *,
                 materialize_master_grads: bool = True) -> None:
        if amsgrad:
            raise ValueError("FusedLAMB(amsgrad=True) is not offered (Apex's FusedLAMB refused it too).")
        check_moment_options(lr, eps, weight_decay, betas)
        check_real("max_grad_norm", max_grad_norm, 0.0)
        if max_grad_norm == 0:
            raise ValueError("Invalid max_grad_norm: 0; the gradients are clipped to this global norm, so "
                             "it must be positive (float('inf') turns the clipping off).")
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=bool(grad_averaging),
                        max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, materialize_master_grads, set_grad_none)
        self.adam_w_mode = bool(adam_w_mode)
        self.use_nvlamb = bool(use_nvlamb)

    def _step_groups(self, plans: list[dict[BucketKey, Bucket]], found_inf: torch.Tensor | None,
                     inv_scale: Scalar, model_inv_scale: Scalar) -> None:
        """The global gradient norm over every group first (Apex's), then each group's step."""
        global_norm = _global_grad_norm(plans, inv_scale, model_inv_scale)
        for group, buckets in zip(self.param_groups, plans):
            if buckets:
                self._step_lamb_group(group, buckets, found_inf, inv_scale, model_inv_scale, global_norm)

    def _step_lamb_group(self, group: dict[str, Any], buckets: dict[BucketKey, Bucket],
                         found_inf: torch.Tensor | None, inv_scale: Scalar, model_inv_scale: Scalar,
                         global_norm: torch.Tensor) -> None:
        step = self._begin_group_step(group, buckets, found_inf)
        if step is None:
            return
        beta1, beta2 = group["betas"]
        for (device, _, _, _, from_model, _), bucket in buckets.items():
            lists = moment_lists(self.state, bucket)
            # multi_tensor_lamb does not step remainders: it steps their masters, rebuilt for the call.
            stepped = remainder.stepped_as_masters(lists, None) if bucket.remainders else contextlib.nullcontext(lists)
            with stepped as lists:
                multi_tensor_applier(multi_tensor_lamb, self._noop_flag(device, found_inf), lists,
                                     group["lr"], beta1, beta2,
                                     group["eps"], step, int(group["bias_correction"]), group["weight_decay"],
                                     int(group["grad_averaging"]), int(self.adam_w_mode), global_norm.to(device),
                                     self.defaults["max_grad_norm"], self.use_nvlamb,
                                     model_inv_scale if from_model else inv_scale)


def _global_grad_norm(plans: list[dict[BucketKey, Bucket]], inv_scale: Scalar,
                      model_inv_scale: Scalar) -> torch.Tensor:
    """The L2 norm of every gradient a step reads, unscaled, as a 1-element fp32 tensor on the
    first gradient's device: each tensor's norm times its scale, then the norm of those. PyTorch's
    ops on whichever path the kernels take, so that the kernels' results never depend on it."""
    norms = []
    for buckets in plans:
        for (_, _, _, _, from_model, _), bucket in buckets.items():
            scale = model_inv_scale if from_model else inv_scale
            bucket_norms = torch.stack(foreach_norm(bucket.grads, 2, dtype=torch.float32))
            norms.append(bucket_norms * scale if isinstance(scale, torch.Tensor) or scale != 1.0
                         else bucket_norms)
    if not norms:
        return torch.zeros(1, dtype=torch.float32)
    device = norms[0].device
    return torch.linalg.vector_norm(torch.cat([n.to(device) for n in norms])).reshape(1)
