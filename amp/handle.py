"""``amp.scale_loss``: scale the loss for backward, then unscale into master grads and check overflow.

This module checks the arguments and finds the ``amp.initialize`` run the optimizers belong to;
the block itself is run by the optimizers' controllers (``_controller.block``), whose loss scaler
does the numbers (``scaler.py``) with the multi-tensor kernels (``multi_tensor_apply.py``).
``torch.compile`` does not trace the block's entry and exit (``_UntracedBlock``).
"""
from __future__ import annotations

import contextlib
from types import TracebackType
from typing import ContextManager, Iterator, Sequence

import torch

from ._amp_state import _amp_state
from ._compat import eager_under_compile
from ._controller.block import scale_loss_block
from .casting import AmpHandle, NoOpHandle, disable_casts  # noqa: F401  (Apex's names on this module)
from ._fsdp import check_order
from ._optimizer_wrappers import OptimizerLike, is_optimizer
from ._run import AmpContext

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


class _UntracedBlock:
    """A ``scale_loss`` block whose entry and exit ``torch.compile`` does not trace but runs as they are.

    A compiled step breaks its graph at the block anyway (autograd runs the backward inside it), so
    amp's work there runs as in eager mode, as ``torch.amp.GradScaler``'s does: a compiled step
    gets eager amp's results and checks, and guards on none of amp's state (no recompiles).
    """

    __slots__ = ("_block",)

    def __init__(self, block: ContextManager[torch.Tensor]) -> None:
        self._block = block

    @eager_under_compile
    def __enter__(self) -> torch.Tensor:
        return self._block.__enter__()

    @eager_under_compile
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> bool | None:
        return self._block.__exit__(exc_type, exc, traceback)


def scale_loss(loss: torch.Tensor, optimizers: OptimizerLike | Sequence[OptimizerLike] | None,
               loss_id: int = 0, model: object = None, delay_unscale: bool = False,
               delay_overflow_check: bool = False) -> ContextManager[torch.Tensor]:
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

    In a step compiled whole with ``torch.compile`` the block's entry and exit run eagerly, as
    ``torch.amp.GradScaler``'s work does: the graph breaks at the block (autograd runs the backward
    inside it), and amp's checks and bits are eager amp's.
    """
    return _UntracedBlock(_scale_loss_block(loss, optimizers, loss_id, delay_unscale, delay_overflow_check))


@contextlib.contextmanager
def _scale_loss_block(loss: torch.Tensor, optimizers: OptimizerLike | Sequence[OptimizerLike] | None,
                      loss_id: int, delay_unscale: bool, delay_overflow_check: bool) -> Iterator[torch.Tensor]:
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
    with scale_loss_block(context, optimizers, scaler, loss_id, loss, delay_unscale,
                          delay_overflow_check) as scaled_loss:
        yield scaled_loss
