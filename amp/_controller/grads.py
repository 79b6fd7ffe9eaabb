"""Gradients around a backward: set aside before it, unscaled after it, put back if it fails.

A backward inside ``scale_loss`` writes fresh, scaled gradients. Those accumulated before it (an
earlier block of the same step) wait in a slot while it runs and are added back as the new ones
are unscaled, so accumulation is never lost and no gradient is unscaled twice. A param that is
its own master (fp32, or any param without master weights) is unscaled in place
(``GradStash``); under master weights a low-precision param's grad is unscaled into its fp32
master's grad (``MasterGrads``), which holds what was accumulated.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from .._compat import coalesced_sparse_coo_tensor
from .._logging import warn_at_caller

if TYPE_CHECKING:
    from ..scaler import Unscaler

__all__ = ["GradStash", "GradsAtExit", "MasterGrads", "put_back", "set_aside", "unscale_in_place",
           "unscaled_sparse"]


def set_aside(params: list[torch.Tensor], slots: list[torch.Tensor | None]) -> None:
    """Set aside the grads that exist before a backward; they are added back once it is unscaled.

    The slots are all None between backward passes, so with no grads (``zero_grad`` sets them to
    None) there is nothing to do, and nothing is written.
    """
    if all(param.grad is None for param in params):
        return
    for index, param in enumerate(params):
        slots[index] = param.grad
        param.grad = None


def put_back(params: list[torch.Tensor], slots: list[torch.Tensor | None]) -> None:
    """Put back the grads ``set_aside`` set aside (a failed backward)."""
    for index, param in enumerate(params):
        param.grad = slots[index]
        slots[index] = None


def unscaled_sparse(unscaler: Unscaler, grad: torch.Tensor, dtype: torch.dtype,
                    previous: torch.Tensor | None) -> torch.Tensor:
    """``grad`` (sparse COO, scaled) unscaled into ``dtype``, plus ``previous`` (already unscaled).

    Its values join the scaler's overflow check like dense grads do (coalesced first, so each
    row is counted once, as torch's GradScaler does).
    """
    grad = grad.coalesce()
    values = grad._values()
    out = values if values.dtype == dtype else torch.empty_like(values, dtype=dtype)
    unscaler.unscale_into([values], [out], models_are_masters=out is values)
    unscaled = coalesced_sparse_coo_tensor(grad._indices(), out, grad.shape)
    return unscaled if previous is None else previous + unscaled


def unscale_in_place(unscaler: Unscaler, params: list[torch.Tensor], slots: list[torch.Tensor | None]) -> None:
    """Unscale new grads in place; add back what was set aside before this backward (never lost)."""
    if all(slot is None for slot in slots):
        # The common case, a backward after zero_grad: one list, no per-parameter branching.
        fresh = [grad for grad in (param.grad for param in params) if grad is not None]
        if not any(grad.is_sparse for grad in fresh):
            if fresh:
                unscaler.unscale_into(fresh, fresh, models_are_masters=True)
            return
    fresh, with_stash, stashed = [], [], []
    for index, param in enumerate(params):
        previous = slots[index]
        slots[index] = None
        if param.grad is None:
            param.grad = previous
        elif param.grad.is_sparse:
            param.grad = unscaled_sparse(unscaler, param.grad, param.dtype, previous)
        elif previous is None:
            fresh.append(param.grad)
        else:
            with_stash.append(param.grad)
            stashed.append(previous)
    if fresh:
        unscaler.unscale_into(fresh, fresh, models_are_masters=True)
    if with_stash:
        unscaler.unscale_with_stashed(with_stash, stashed, with_stash)


class GradStash:
    """Params that are their own masters, each with the slot its grad waits in during a backward."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.slots: list[torch.Tensor | None] = []

    def add(self, params: Iterable[torch.Tensor]) -> None:
        for param in params:
            self.params.append(param)
            self.slots.append(None)

    def set_aside(self) -> None:
        set_aside(self.params, self.slots)

    def put_back(self) -> None:
        put_back(self.params, self.slots)

    def unscale(self, unscaler: Unscaler) -> None:
        unscale_in_place(unscaler, self.params, self.slots)


class MasterGrads:
    """The fp32 tensors that receive the masters' unscaled grads, one per master, allocated once.

    Every step sets the masters' ``.grad`` back to None, so no step sees another's values; reusing
    the tensors saves an allocation per parameter per step.
    """

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor | None] = []

    def add(self, count: int) -> None:
        self.buffers += [None] * count

    def buffer(self, index: int, master: torch.Tensor) -> torch.Tensor:
        """The buffer of ``master`` (the ``index``-th), allocated on first use."""
        buffer = self.buffers[index]
        if buffer is None:
            buffer = self.buffers[index] = torch.empty_like(master)
        return buffer

    def unscale(self, unscaler: Unscaler, model_params: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
        """Unscale the model's grads into (or onto) the masters' grads."""
        fresh_model, fresh_master, acc_model, acc_master = [], [], [], []
        for index, (param, master) in enumerate(zip(model_params, masters)):
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                master.grad = unscaled_sparse(unscaler, grad, master.dtype, master.grad)
            elif master.grad is None:
                master.grad = self.buffer(index, master)
                fresh_model.append(grad)
                fresh_master.append(master.grad)
            else:
                acc_model.append(grad)
                acc_master.append(master.grad)
        if fresh_model:
            unscaler.unscale_into(fresh_model, fresh_master)
        if acc_model:
            unscaler.unscale_with_stashed(acc_model, acc_master, acc_master)


class GradsAtExit:
    """The model's low-precision grads as a ``scale_loss`` block left them, to notice a later write.

    Under master weights the step never reads what is written to the model's grads after the
    block exits (the masters' grads were unscaled from them there), so clipping them, the
    GradScaler habit, silently does nothing. Each grad's identity and version counter say whether
    it was replaced (``p.grad = ...``) or changed in place (every in-place op, ``clip_grad_norm_``
    included, bumps the counter; writes through ``p.grad.data`` bypass it and go unseen), read on
    the host without a sync. Writes during the backward (DDP's all-reduce) come before the block exits.
    """

    def __init__(self) -> None:
        self.grads: list[torch.Tensor | None] | None = None
        self.versions: list[int] = []
        self.warned = False

    def note(self, params: list[torch.Tensor]) -> None:
        self.grads = [param.grad for param in params]
        self.versions = [grad._version for grad in self.grads if grad is not None]

    def changed(self, params: list[torch.Tensor]) -> bool:
        """Whether a grad of ``params`` (the list ``note`` saw) was replaced or written since."""
        if self.grads is None:
            return False
        grads = [param.grad for param in params]
        if len(grads) != len(self.grads) or any(now is not then for now, then in zip(grads, self.grads)):
            return True
        return [grad._version for grad in grads if grad is not None] != self.versions

    def warn_if_changed(self, params: list[torch.Tensor]) -> None:
        """At a step: warn (once) if a grad of ``params`` was written after the block exited, then forget."""
        if not self.warned and self.changed(params):
            self.warned = True
            warn_at_caller(
                "amp: the model's low-precision gradients were changed after amp.scale_loss exited "
                "(torch.nn.utils.clip_grad_norm_(model.parameters(), ...)? p.grad = ...?). Under "
                "master weights (O2/O5) the step is taken on the fp32 master weights, whose gradients amp unscaled "
                "from the model's at the block's exit, and the model's gradients still carry the loss "
                "scale (a norm computed from them is the scaled one): the change does nothing to the "
                "step, or with an amp.optimizers optimizer scales it by a factor computed from scaled "
                "gradients. Clip or change the masters' gradients instead: "
                "torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm). (Warned once "
                "per optimizer.)")
        self.forget()

    def forget(self) -> None:
        """Drop the references (the step, or ``zero_grad``, is over with these grads)."""
        self.grads, self.versions = None, []
