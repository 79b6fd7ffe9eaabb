"""One ``amp.scale_loss`` block over its optimizers: enter, then unscale, check and update on exit.

``amp.scale_loss`` (``handle.py``) checks its arguments and finds the run; ``scale_loss_block``
runs the block. It takes a dynamic loss scaler for this thread, moves every optimizer's
controller into the block (``begin_backward``) or none, yields the scaled loss, and on exit has
each controller unscale its grads (``end_backward``) with the scaler, by the scale this block's
loss was multiplied by, then agrees on the overflow across processes, updates the scale and notes
the overflow flag for the next step. If the body raises, every controller puts its grads back
(``abort_backward``).
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
import torch.distributed as dist

from ..scaler import LossScaler, ScaledBy, Unscaler
from .controller import OptimizerController

if TYPE_CHECKING:
    from .._run import AmpContext

__all__ = ["controller_of", "scale_loss_block"]


def controller_of(optimizer: Any) -> OptimizerController:
    """The controller ``amp.initialize`` gave ``optimizer`` (its ``_amp_stash``)."""
    return optimizer._amp_stash


def _check_no_shared_params(controllers: Sequence[OptimizerController]) -> None:
    """A parameter stepped by two optimizers would be unscaled (and updated) twice."""
    owner: dict[torch.Tensor, int] = {}
    for index, controller in enumerate(controllers):
        for param in controller.model_params():
            other = owner.setdefault(param, index)
            if other != index:
                name = controller.param_names.get(param, "a parameter")
                raise ValueError(
                    f"{name} belongs to optimizers {other} and {index} of this scale_loss call, so "
                    "its gradient would be unscaled and stepped twice. Give each parameter to "
                    "exactly one optimizer.")


# The thread whose scale_loss blocks hold each dynamic loss scaler, and its open blocks there
# (innermost last). Blocks of two threads on one scaler would race: one block's exit updates the
# scale in place while the other's loss, multiplied by it, still waits for its backward and its
# unscaling, and each exit clears the overflow flag that the other is filling.
_scaler_holders: weakref.WeakKeyDictionary[LossScaler, tuple[int, list[_OpenBlock]]] = (
    weakref.WeakKeyDictionary())
# Makes checking and taking a scaler, and the optimizers' phase changes, one step across threads.
_blocks_lock = threading.Lock()


def _check_scaler_free(scaler: LossScaler, loss_id: int) -> None:
    holder = _scaler_holders.get(scaler)
    if holder is not None and holder[0] != threading.get_ident():
        raise RuntimeError(
            f"amp.scale_loss: loss scaler {loss_id} of this amp.initialize call is in use by a "
            "scale_loss block open in another thread. One dynamic loss scaler cannot serve two "
            "threads at once: one block's scale update would change the scale that the other's "
            "loss was multiplied by, and their overflow checks would mix. Give each thread its own "
            "loss scaler: amp.initialize(..., num_losses=<number of threads>) and "
            "amp.scale_loss(..., loss_id=<this thread's id>), or call amp.initialize once per thread.")


class _OpenBlock:
    """A block open on a dynamic scaler. ``scale``: a copy of the scale its loss was multiplied by,
    taken when a nested block of its thread opened on the same scaler (that block's exit updates it)."""

    __slots__ = ("scale",)

    def __init__(self) -> None:
        self.scale: torch.Tensor | None = None


def _begin_backward(controllers: Sequence[OptimizerController], set_aside_grads: bool,
                    scaler: LossScaler | None = None, loss_id: int = 0) -> _OpenBlock | None:
    """Every optimizer enters the block, or none does: a nested block raises before any change.

    A dynamic ``scaler`` is taken for this thread until ``_release_scaler``; a block of another
    thread that holds it raises, before any change, too. Returns this block's ``_OpenBlock``
    (None without a dynamic scaler).
    """
    held = scaler if scaler is not None and scaler.dynamic else None
    with _blocks_lock:
        if held is not None:
            _check_scaler_free(held, loss_id)
        for controller in controllers:
            controller.check_can_begin_backward()
        for controller in controllers:
            controller.begin_backward(set_aside_grads)
        if held is None:
            return None
        block = _OpenBlock()
        _, blocks = _scaler_holders.setdefault(held, (threading.get_ident(), []))
        if blocks and blocks[-1].scale is None:
            # Only the exit of a block nested in the enclosing one updates the scale, and this is the
            # first such block: the scale is still the one the enclosing block multiplied its loss by.
            blocks[-1].scale = held.scale_tensor_copy()
        blocks.append(block)
        return block


def _release_scaler(scaler: LossScaler, block: _OpenBlock | None) -> None:
    """``block``, opened on ``scaler`` by ``_begin_backward``, is closed."""
    if block is None:
        return
    with _blocks_lock:
        _, blocks = _scaler_holders[scaler]
        blocks.remove(block)
        if not blocks:
            del _scaler_holders[scaler]


def _clear_cast_cache(context: AmpContext) -> None:
    if context.casting_policy is not None:
        context.casting_policy._clear_cache()


@contextlib.contextmanager
def scale_loss_block(context: AmpContext, optimizers: Sequence[Any], scaler: LossScaler, loss_id: int,
                     loss: torch.Tensor, delay_unscale: bool, delay_overflow_check: bool) -> Iterator[torch.Tensor]:
    """The block of ``amp.scale_loss(loss, optimizers, loss_id, ...)`` in the run ``context``."""
    controllers = [controller_of(optimizer) for optimizer in optimizers]
    if not context.options.master_weights and not scaler.dynamic and scaler.loss_scale() == 1.0:
        # Nothing to scale or unscale, and a static scale checks nothing: the block only marks
        # the optimizers busy, and leaves them as it found them.
        _begin_backward(controllers, set_aside_grads=False)
        try:
            yield loss.float()
        finally:
            for controller in controllers:
                controller.abort_backward()
            _clear_cast_cache(context)
        return

    if not optimizers:
        raise TypeError("scale_loss needs the optimizer(s) whose gradients it unscales (got None): "
                        "only a static loss scale of 1.0 without master weights works without them.")
    if len(optimizers) > 1:
        _check_no_shared_params(controllers)
    block = _begin_backward(controllers, not delay_unscale, scaler, loss_id)
    try:
        scale = scaler.scale_tensor(loss.device)
        # A dynamic scale changes in place at the exit of a block nested in this one, and this
        # loss's backward (after that exit) needs the scale it was multiplied by: a copy.
        yield loss.float() * (scale if block is None else scale.clone())
        _unscale_and_check(controllers, context, scaler, loss_id, delay_unscale, delay_overflow_check, block)
    except BaseException:
        # Optimizers whose gradients were not unscaled get back those from before the block.
        for controller in controllers:
            controller.abort_backward()
        raise
    finally:
        _release_scaler(scaler, block)
        _clear_cast_cache(context)


def _unscale_and_check(controllers: Sequence[OptimizerController], context: AmpContext,
                       scaler: LossScaler, loss_id: int, delay_unscale: bool, delay_overflow_check: bool,
                       block: _OpenBlock | None) -> None:
    if delay_unscale:
        for controller in controllers:
            controller.end_backward(None)
        return
    scaler.clear_overflow_state()
    # A nested block may have updated the scale since this block's loss was multiplied by it.
    unscaler: Unscaler = scaler if block is None or block.scale is None else ScaledBy(scaler, block.scale)
    for controller in controllers:
        controller.end_backward(unscaler)
    if delay_overflow_check:
        return
    group = context.overflow_process_group
    if scaler.dynamic and group is not None:
        dist.all_reduce(scaler.found_inf(), op=dist.ReduceOp.MAX, group=group)
    found_inf = scaler.update_scale_()
    if scaler.dynamic:
        for controller in controllers:
            controller.note_found_inf(loss_id, found_inf)
