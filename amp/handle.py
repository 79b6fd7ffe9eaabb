"""``amp.scale_loss``: scale the loss for backward, then unscale into master grads and check overflow."""
import contextlib

import torch
import torch.distributed as dist

from ._amp_state import _amp_state

__all__ = ["scale_loss"]


def _optimizer_list(optimizers):
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    elif isinstance(optimizers, (list, tuple)):
        optimizers = list(optimizers)
    else:
        raise TypeError("scale_loss expects an optimizer or a list/tuple of optimizers, got "
                        f"{type(optimizers).__name__}.")
    for optimizer in optimizers:
        if not hasattr(optimizer, "_amp_stash"):
            raise RuntimeError("An optimizer passed to amp.scale_loss was not returned by "
                               "amp.initialize; pass every optimizer through amp.initialize first.")
    return optimizers


def _clear_cast_cache():
    if _amp_state.opt_properties.patch_torch_functions and _amp_state.handle is not None:
        _amp_state.handle._clear_cache()


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False,
               delay_overflow_check=False):
    """Yield ``loss.float() * loss_scale`` for ``.backward()``; on exit, unscale and check overflow.

    On a clean exit the gradients of every optimizer passed are unscaled (into the fp32 master
    grads under O2/O5; the model's own low-precision grads stay scaled) and, with a dynamic loss
    scale, checked for inf/NaN; the scale is updated on the device, and the next
    ``optimizer.step()`` is skipped if any gradient was not finite. Gradients accumulate across
    several ``scale_loss`` blocks before a step.

    Args:
        loss: the loss tensor.
        optimizers: the optimizer(s) that own every parameter receiving gradients in this backward.
        loss_id (int): which loss scaler to use, in ``range(num_losses)``.
        model: unused (Apex compatibility).
        delay_unscale (bool): leave the gradients scaled (expert accumulation optimisation); the
            next non-delayed ``scale_loss`` unscales everything once. Do not step in between.
        delay_overflow_check (bool): unscale, but neither check overflow nor update the scale.

    If the body raises, the gradients are put back as they were before the block.
    """
    properties = _amp_state.opt_properties
    if properties is None:
        raise RuntimeError("Invoked 'with amp.scale_loss`, but internal Amp state has not been "
                           "initialized. model, optimizer = amp.initialize(model, optimizer, "
                           "opt_level=...) must be called before `with amp.scale_loss`.")
    if not properties.enabled:
        yield loss
        return
    scalers = _amp_state.loss_scalers
    if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < len(scalers):
        raise IndexError(f"loss_id={loss_id!r} is out of range: amp.initialize was called with "
                         f"num_losses={len(scalers)}, so loss_id must be in 0..{len(scalers) - 1}.")
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"scale_loss expects the loss tensor, got {type(loss).__name__}.")
    scaler = scalers[loss_id]

    if not properties.master_weights and not scaler.dynamic and scaler.loss_scale() == 1.0:
        # Nothing to scale or unscale, and a static scale checks nothing: no work at all.
        try:
            yield loss.float()
        finally:
            _clear_cast_cache()
        return

    optimizers = _optimizer_list(optimizers)
    prepared = []
    if not delay_unscale:
        for optimizer in optimizers:
            if not optimizer._amp_stash.params_have_scaled_gradients:
                optimizer._prepare_amp_backward()
                prepared.append(optimizer)

    try:
        yield loss.float() * scaler.scale_tensor(loss.device)
    except BaseException:
        for optimizer in prepared:
            optimizer._restore_after_failed_backward()
        raise
    else:
        if delay_unscale:
            for optimizer in optimizers:
                optimizer._amp_stash.params_have_scaled_gradients = True
            return
        scaler.clear_overflow_state()
        for optimizer in optimizers:
            optimizer._post_amp_backward(scaler)
            optimizer._amp_stash.params_have_scaled_gradients = False
        if delay_overflow_check:
            return
        group = _amp_state.overflow_process_group
        if scaler.dynamic and group is not None:
            dist.all_reduce(scaler.found_inf(), op=dist.ReduceOp.MAX, group=group)
        found_inf = scaler.update_scale_()
        if scaler.dynamic:
            for optimizer in optimizers:
                flags = optimizer._amp_stash.found_inf_by_loss
                previous = flags.get(loss_id)
                flags[loss_id] = found_inf if previous is None else torch.maximum(previous, found_inf)
    finally:
        _clear_cast_cache()
