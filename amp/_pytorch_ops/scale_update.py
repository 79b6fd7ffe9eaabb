"""``update_scale_hysteresis``: Apex's dynamic loss-scale update with hysteresis, on the device.

Bits: ``scale * factor`` is computed in fp64 and rounded once to fp32 (Apex's kernel multiplies a
float by a double); growth is stored only if that fp32 value is finite.
"""
import torch

from . import contract, contract_coefficients


def update_scale_hysteresis(current_scale, growth_tracker, hysteresis_tracker, found_inf,
                            growth_factor, backoff_factor, growth_interval, hysteresis,
                            min_scale=None, max_scale=None, inv_scale=None, should_skip=None):
    """Update the loss scale in place, on its device, from ``found_inf``; returns ``current_scale``.

    An overflow (``found_inf > 0``) decrements ``hysteresis_tracker``; while it stays above zero the
    overflow is tolerated (growth tracker zeroed, scale kept), otherwise the scale is multiplied by
    ``backoff_factor`` and the growth tracker zeroed. A clean step counts one more success in
    ``growth_tracker``: reaching ``growth_interval`` multiplies the scale by ``growth_factor`` (only if
    the result is finite) and restarts the count; either way ``hysteresis_tracker`` is reset to
    ``hysteresis``. Never synchronises with the host.

    The optional trailing arguments (not Apex's) let one call do a whole update of amp's scaler:
    the new scale is clamped into ``[min_scale, max_scale]`` (as ``torch.clamp_`` does, either may
    be None); ``inv_scale`` (1-element float32) receives ``1 / scale`` divided in fp64 and rounded
    to fp32; ``should_skip`` (1-element float32) receives 1.0 if ``found_inf`` was set, else 0.0.
    """
    op = "update_scale_hysteresis"
    device = current_scale.device if isinstance(current_scale, torch.Tensor) else None
    for name, t, dtype in (("current_scale", current_scale, torch.float32),
                           ("growth_tracker", growth_tracker, torch.int32),
                           ("hysteresis_tracker", hysteresis_tracker, torch.int32),
                           ("found_inf", found_inf, torch.float32)):
        contract_coefficients.check_state_tensor(op, name, t, dtype, device)
    growth_factor = contract.real(op, "growth_factor", growth_factor)
    backoff_factor = contract.real(op, "backoff_factor", backoff_factor)
    growth_interval = contract_coefficients.int32(op, "growth_interval", growth_interval)
    hysteresis = contract_coefficients.int32(op, "hysteresis", hysteresis)
    min_scale = contract_coefficients.scale_bound(op, "min_scale", min_scale)
    max_scale = contract_coefficients.scale_bound(op, "max_scale", max_scale)
    outputs = [(name, t) for name, t in (("inv_scale", inv_scale), ("should_skip", should_skip))
               if t is not None]
    for name, t in outputs:
        contract_coefficients.check_state_tensor(op, name, t, torch.float32, device)
    for name, t in [("current_scale", current_scale), ("growth_tracker", growth_tracker),
                    ("hysteresis_tracker", hysteresis_tracker)] + outputs:
        contract.check_writable(op, t, name)
    with torch.no_grad():
        scale = current_scale.reshape(())
        growth = growth_tracker.reshape(())
        overflow = found_inf.reshape(()) > 0
        hysteresis_left = torch.where(overflow, hysteresis_tracker.reshape(()) - 1, hysteresis)
        back_off = overflow & (hysteresis_left <= 0)
        successes = growth + 1
        grow = ~overflow & (successes == growth_interval)
        grown = (scale.double() * growth_factor).float()
        shrunk = (scale.double() * backoff_factor).float()
        new_scale = torch.where(back_off, shrunk, torch.where(grow & grown.isfinite(), grown, scale))
        new_growth = torch.where(overflow | grow, 0, successes)
        if min_scale is not None or max_scale is not None:
            new_scale = new_scale.clamp(min_scale, max_scale)
        if should_skip is not None:
            should_skip.copy_(overflow)
        current_scale.copy_(new_scale)
        growth_tracker.copy_(new_growth)
        hysteresis_tracker.copy_(hysteresis_left)
        if inv_scale is not None:
            inv_scale.copy_(new_scale.double().reciprocal())
    return current_scale
