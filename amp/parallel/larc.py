"""``LARC``: layer-wise adaptive learning rates around any optimizer, with Apex's semantics.

For every parameter with a gradient, the step of the wrapped optimizer is rescaled by a local
learning rate ``trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)`` (You et al.,
"Large Batch Training of Convolutional Networks"). With ``clip=True`` the local rate is divided
by the group's ``lr`` and capped at 1 (so the effective rate is ``min(local, lr)``); with
``clip=False`` it multiplies ``lr``. Weight decay is folded into the gradient before the
rescaling, and the wrapped optimizer runs with ``weight_decay=0`` for that step. A parameter whose
weight or gradient is zero keeps its gradient as it is (and gets no weight decay that step).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

__all__ = ["LARC"]


class LARC:
    """Wrap ``optimizer`` (a ``torch.optim.Optimizer``) with layer-wise adaptive rate control.

    Example::

        optimizer = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         trust_coefficient=0.02, clip=True)
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2")

    Like Apex's, it is a plain object, not an ``Optimizer`` subclass: ``param_groups``, ``state``,
    ``state_dict``, ``load_state_dict``, ``zero_grad`` and ``add_param_group`` are the wrapped
    optimizer's, and ``step()`` takes no closure. ``amp.initialize`` and ``amp.scale_loss`` accept
    it as one optimizer.

    Args:
        optimizer: the optimizer whose steps are rescaled.
        trust_coefficient (float): the trust ratio's coefficient (default 0.02).
        clip (bool): cap the local rate at the group's ``lr`` (default True) instead of scaling it.
        eps (float): added to the denominator (default 1e-8).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, trust_coefficient: float = 0.02, clip: bool = True,
                 eps: float = 1e-8) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"LARC wraps a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        for name, value in (("trust_coefficient", trust_coefficient), ("eps", eps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"LARC's {name} must be a number >= 0, got {value!r}.")
        if not isinstance(clip, bool):
            raise TypeError(f"LARC's clip must be True or False, got {clip!r}.")
        self.optim = optimizer
        self.trust_coefficient = float(trust_coefficient)
        self.clip = clip
        self.eps = float(eps)

    def __repr__(self) -> str:
        return (f"LARC(trust_coefficient={self.trust_coefficient}, clip={self.clip}, eps={self.eps}, "
                f"optimizer={self.optim!r})")

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property
    def state(self) -> defaultdict[torch.Tensor, Any]:
        return self.optim.state

    @state.setter
    def state(self, value: defaultdict[torch.Tensor, Any]) -> None:
        self.optim.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optim.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    @torch.no_grad()
    def step(self) -> None:
        """Rescale every gradient by its local rate, then step the wrapped optimizer."""
        weight_decays = [group.get("weight_decay", 0) for group in self.optim.param_groups]
        try:
            for group, weight_decay in zip(self.optim.param_groups, weight_decays):
                # The wrapped optimizer must not decay again what is folded into the gradient.
                group["weight_decay"] = 0
                for param in group["params"]:
                    if param.grad is not None:
                        self._rescale_grad(param, param.grad, weight_decay, group["lr"])
            self.optim.step()
        finally:
            for group, weight_decay in zip(self.optim.param_groups, weight_decays):
                group["weight_decay"] = weight_decay

    def _rescale_grad(self, param: torch.Tensor, grad: torch.Tensor, weight_decay: float, lr: float) -> None:
        # Norms in fp32 whatever the parameter's dtype, as the ratio of two fp16 norms is coarse.
        param_norm = torch.linalg.vector_norm(param, dtype=torch.float32)
        grad_norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
        local_lr = self.trust_coefficient * param_norm / (grad_norm + weight_decay * param_norm + self.eps)
        if self.clip:
            local_lr = torch.clamp(local_lr / lr, max=1.0)
        # A zero weight or a zero gradient leaves the gradient untouched, without its weight decay
        # (Apex's rule); decided on the device, so the step makes no host sync.
        rescale = (param_norm != 0) & (grad_norm != 0)
        if weight_decay != 0:
            grad.add_(param * torch.where(rescale, weight_decay, 0.0).to(param.dtype))
        grad.mul_(torch.where(rescale, local_lr, 1.0))
