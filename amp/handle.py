"""``amp.scale_loss``: scale the loss for backward, then unscale into master grads and check overflow.

The per-optimizer work is its controller's (``optimizer._amp_stash``): the block calls
``begin_backward``, then ``end_backward`` (or ``abort_backward`` if the body raised). This module
checks the arguments and does what the optimizers of one call share: the scaling and the overflow
check.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from ._amp_state import _amp_state
from ._optimizer_wrappers import OptimizerLike, is_optimizer
from ._fsdp import check_order
from ._process_optimizer import OptimizerController, controller_of
from ._run import AmpContext
from .scaler import LossScaler, ScaledBy, Unscaler

__all__ = ["scale_loss"]

_NOT_INITIALIZED = ("Invoked 'with amp.scale_loss`, but internal Amp state has not been initialized. "
                    "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be "
                    "called before `with amp.scale_loss`.")


def _optimizer_list(optimizers: OptimizerLike | Sequence[OptimizerLike]) -> list[OptimizerLike]:
    if is_optimizer(optimizers):
        return [optimizers]
    if isinstance(optimizers, (list, tuple)):
        optimizers = list(optimizers)
        for optimizer in optimizers:
            if not is_optimizer(optimizer):
                raise TypeError("scale_loss expects optimizers, got a "
                                f"{type(optimizer).__name__} in the list.")
        if not optimizers:
            raise ValueError("scale_loss got an empty list of optimizers: pass the optimizer(s) "
                             "that own the parameters this backward reaches.")
        if len({id(opt) for opt in optimizers}) != len(optimizers):
            raise ValueError("The same optimizer appears more than once in this scale_loss call; "
                             "its gradients would be unscaled twice. Pass each optimizer once.")
        return optimizers
    raise TypeError("scale_loss expects an optimizer or a list/tuple of optimizers, got "
                    f"{type(optimizers).__name__}.")


def _context_of(optimizers: Sequence[OptimizerLike]) -> AmpContext | None:
    """The ``AmpContext`` of the ``initialize`` that returned these optimizers (None: pass through)."""
    contexts: set[AmpContext | None] = set()
    for optimizer in optimizers:
        stash = getattr(optimizer, "_amp_stash", None)
        if stash is not None:
            contexts.add(stash.context)
        elif optimizer in _amp_state.disabled_optimizers:
            contexts.add(None)
        elif _amp_state.context is None:
            raise RuntimeError(_NOT_INITIALIZED)
        elif _amp_state.context.enabled:
            raise RuntimeError("An optimizer passed to amp.scale_loss was not returned by "
                               "amp.initialize; pass every optimizer through amp.initialize first.")
        else:
            contexts.add(None)  # Apex: after initialize(enabled=False), scale_loss is a no-op
    if len(contexts) > 1:
        raise ValueError("The optimizers passed to this scale_loss come from different "
                         "amp.initialize calls, which have their own options and loss scalers. "
                         "Use one scale_loss block per amp.initialize call.")
    return contexts.pop()


def _latest_context_for_no_optimizers() -> AmpContext:
    if _amp_state.context is None:
        raise RuntimeError(_NOT_INITIALIZED)
    return _amp_state.context


def _check_no_shared_params(optimizers: Sequence[OptimizerLike]) -> None:
    """A parameter stepped by two optimizers would be unscaled (and updated) twice."""
    owner: dict[torch.Tensor, int] = {}
    for index, optimizer in enumerate(optimizers):
        for param in controller_of(optimizer).model_params():
            other = owner.setdefault(param, index)
            if other != index:
                name = controller_of(optimizer).param_names.get(param, "a parameter")
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
def scale_loss(loss: torch.Tensor, optimizers: OptimizerLike | Sequence[OptimizerLike] | None,
               loss_id: int = 0, model: object = None, delay_unscale: bool = False,
               delay_overflow_check: bool = False) -> Iterator[torch.Tensor]:
    """Yield ``loss.float() * loss_scale`` for ``.backward()``; on exit, unscale and check overflow.

    On a clean exit the gradients of every optimizer passed are unscaled (into the fp32 master
    grads under O2/O5; the model's own low-precision grads stay scaled) and, with a dynamic loss
    scale, checked for inf/NaN; the scale is updated on the device, and the next
    ``optimizer.step()`` is skipped if any gradient was not finite. Gradients accumulate across
    several ``scale_loss`` blocks before a step.

    Args:
        loss: the loss tensor.
        optimizers: the optimizer(s) that own every parameter receiving gradients in this backward;
            all from the same ``amp.initialize`` call, each once, no parameter in two of them.
        loss_id (int): which loss scaler to use, in ``range(num_losses)``.
        model: unused (Apex compatibility).
        delay_unscale (bool): leave the gradients scaled (expert accumulation optimisation); the
            next non-delayed ``scale_loss`` unscales everything once. ``step()`` in between raises.
        delay_overflow_check (bool): unscale, but neither check overflow nor update the scale.

    If the body raises, the gradients are put back as they were before the block. Misuse raises
    before anything changes: a nested block on the same optimizer, an optimizer twice, a
    parameter shared by two optimizers, optimizers of different ``initialize`` calls, a block
    whose dynamic loss scaler is held by a block open in another thread (give each thread its
    own ``loss_id``, or its own ``initialize`` call).
    """
    context: AmpContext | None
    if optimizers is None:
        # Apex accepted None where the scale is a static 1.0 without masters (nothing to unscale).
        optimizers, context = [], _latest_context_for_no_optimizers()
    else:
        optimizers = _optimizer_list(optimizers)
        context = _context_of(optimizers)
    if context is None or not context.enabled:
        yield loss
        return
    scaler = context.loss_scaler(loss_id)
    check_order(context)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"scale_loss expects the loss tensor, got {type(loss).__name__}.")
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
        _check_no_shared_params(optimizers)
    block = _begin_backward(controllers, not delay_unscale, scaler, loss_id)
    try:
        yield loss.float() * scaler.scale_tensor(loss.device)
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
