"""The ``.grad`` of an fp32 master whose gradient was not made: reading it raises instead of finding none.

With ``materialize_master_grads=False`` a fused step reads the model's low-precision grads, and a
master gets an fp32 grad only when ``amp.master_params(optimizer)`` is iterated after the backward.
Apex's masters always had grads, so Apex-era code keeps ``list(amp.master_params(optimizer))`` and
clips it every step: with ``.grad`` None, ``clip_grad_norm_`` would return 0 and clip nothing, and
a logged grad norm would read 0, silently. From a ``scale_loss`` exit to the step each such master
holds an ``UnmadeGrad`` instead: the master's shape, dtype and device, no values, and any operation
on it raises with what to do.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["UnmadeGrad"]


class UnmadeGrad(torch.Tensor):
    """Stands for the unmade fp32 grad of ``master`` (of the model param ``name``, stepped by an
    optimizer of class ``optimizer_name``)."""

    param_name: str
    optimizer_name: str

    @staticmethod
    def __new__(cls, master: torch.Tensor, name: str, optimizer_name: str) -> UnmadeGrad:
        grad = torch.Tensor._make_wrapper_subclass(
            cls, master.shape, strides=master.stride(), dtype=master.dtype, device=master.device)
        grad.param_name, grad.optimizer_name = name, optimizer_name
        return grad

    # Every operation reaches __torch_dispatch__, none runs as a Python-level override first.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        grad = next(leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, cls))
        raise RuntimeError(
            f"The fp32 master of {grad.param_name} has no gradient to read ({func}): "
            f"{grad.optimizer_name}(materialize_master_grads=False) steps from the model's low-precision "
            "gradients and makes the masters' fp32 gradients only when amp.master_params(optimizer) is "
            "iterated after the backward. This master was reached otherwise (a list of "
            "amp.master_params kept from before, or optimizer.param_groups), where its gradient would "
            "be missing and a clip would clip nothing. Iterate amp.master_params(optimizer) again "
            "after each step's last scale_loss block, e.g. clip_grad_norm_(amp.master_params(optimizer), "
            "max_norm), or construct the optimizer with materialize_master_grads=True (the default), "
            "which makes them after every backward.")

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"UnmadeGrad(the fp32 gradient of the master of {self.param_name}, not made: "
                f"{self.optimizer_name}(materialize_master_grads=False))")
