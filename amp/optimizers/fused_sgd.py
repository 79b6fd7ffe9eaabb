"""``FusedSGD``: SGD with momentum in one ``multi_tensor_sgd`` pass per kind of tensor (Apex's optimizer)."""
from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import required

from amp.multi_tensor_apply import Scalar, multi_tensor_applier, multi_tensor_sgd

from ._fused import Bucket, BucketKey, FusedOptimizer, Params, check_real

__all__ = ["FusedSGD"]


class FusedSGD(FusedOptimizer):
    """SGD (optionally with momentum, Nesterov, weight decay) whose update is one fused pass.

    The arithmetic is ``torch.optim.SGD``'s, in fp32 for every parameter dtype: ``g += wd * p``
    (after the momentum update instead with ``wd_after_momentum=True``), ``buf = momentum * buf +
    (1 - dampening) * g`` (``buf = g`` on a parameter's first step), ``g = g + momentum * buf`` with
    ``nesterov`` else ``g = buf``, ``p -= lr * g``. It is an ordinary ``torch.optim.Optimizer``::

        optimizer = amp.optimizers.FusedSGD(model.parameters(), lr=0.1, momentum=0.9)

    Under ``amp.initialize`` at O2/O5 the same pass also writes the rounded fp32 master into the
    fp16/bf16 model parameter, so amp's separate master->model copy is skipped. With
    ``materialize_master_grads=False`` it also reads the model's low-precision gradients directly
    (no fp32 master gradients are made; the loss scale is divided out inside the pass), which saves
    another pass; iterating ``amp.master_params(optimizer)`` between ``scale_loss`` and ``step`` (to
    clip) still makes them, for that step, and a master reached otherwise (a list kept from an
    earlier step) holds a gradient that raises if it is read.

    Args:
        params: parameters or param groups (float32, float16 or bfloat16; dense gradients).
        lr (float): learning rate (required).
        momentum (float, default 0), dampening (float, default 0), weight_decay (float, default 0).
        nesterov (bool, default False): needs ``momentum > 0`` and ``dampening == 0``.
        wd_after_momentum (bool, default False): add the weight decay after the momentum update.
        materialize_master_grads (bool, default True): under amp O2/O5, unscale into fp32 master
            grads (True) or let the step read the model's scaled low-precision grads (False); read
            once, by ``amp.initialize``.
        set_grad_none (bool, default False): what ``zero_grad()`` does without ``set_to_none``.

    Every stepped parameter gets a momentum buffer, also with ``momentum=0`` (as in Apex; the
    kernel then never reads it). A skipped step (``found_inf`` set by amp or GradScaler) writes
    nothing. The first step that
    creates momentum buffers under such a flag reads it once on the host, so that a skipped first
    step leaves no buffer behind; every later step is sync-free.
    """

    def __init__(self, params: Params,
                 lr: float = required,  # type: ignore[assignment]  # torch's sentinel: lr must be given
                 momentum: float = 0, dampening: float = 0, weight_decay: float = 0,
                 nesterov: bool = False, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True, set_grad_none: bool = False) -> None:
        if lr is not required:
            check_real("learning rate", lr, 0.0)
        check_real("momentum value", momentum, 0.0)
        check_real("dampening value", dampening, 0.0, 1.0)
        check_real("weight_decay value", weight_decay, 0.0)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening.")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=bool(nesterov))
        super().__init__(params, defaults, materialize_master_grads, set_grad_none)
        self.wd_after_momentum = bool(wd_after_momentum)

    def _step_group(self, group: dict[str, Any], buckets: dict[BucketKey, Bucket],
                    found_inf: torch.Tensor | None, inv_scale: Scalar, model_inv_scale: Scalar) -> None:
        for (device, _, _, _, from_model, _), bucket in buckets.items():
            scale = model_inv_scale if from_model else inv_scale
            states = [self.state[param] for param in bucket.params]
            started = [i for i, state in enumerate(states) if "momentum_buffer" in state]
            fresh = [i for i, state in enumerate(states) if "momentum_buffer" not in state]
            if started:
                self._sgd(group, bucket.part(started), [states[i]["momentum_buffer"] for i in started],
                          False, device, found_inf, scale)
            # A first step makes the buffers (the op's first_run sets them to the grad); if it may be
            # skipped, the flag is read on the host once, so that a skipped step leaves none behind.
            if fresh and (found_inf is None or not found_inf.item()):
                for i in fresh:
                    states[i]["momentum_buffer"] = torch.zeros_like(bucket.params[i],
                                                                    memory_format=torch.preserve_format)
                self._sgd(group, bucket.part(fresh), [states[i]["momentum_buffer"] for i in fresh],
                          True, device, found_inf, scale)

    def _sgd(self, group: dict[str, Any], bucket: Bucket, bufs: list[torch.Tensor], first_run: bool,
             device: torch.device, found_inf: torch.Tensor | None, scale: Scalar) -> None:
        multi_tensor_applier(multi_tensor_sgd, self._noop_flag(device, found_inf), bucket.op_lists([bufs]),
                             group["weight_decay"], group["momentum"], group["dampening"], group["lr"],
                             group["nesterov"], first_run, self.wd_after_momentum, scale)
