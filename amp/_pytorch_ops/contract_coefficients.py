"""The contract's checks of the ops' coefficients that may be tensors (rule 9 of ``contract``) and of
``update_scale_hysteresis``'s arguments, which ``contract``'s docstring states; their C++ mirrors are
in ``csrc/amp_C_contract.cpp`` too.
"""
import math

import torch

from . import storage
from .contract import INT32_MAX, _type_name, integer, real

FP32_MAX = torch.finfo(torch.float32).max
# The step numbers adam's bias corrections support: the kernels read the step's low 31 bits.
MAX_ADAM_STEP = INT32_MAX
_STEP_DTYPES = (torch.int32, torch.int64, torch.float32)


# ---- rule 9: coefficients that may be tensors -----------------------------------------------------


def fp32_scalar(op, name, value, device):
    """``value`` as a 0-dim fp32 tensor on ``device``, without a host-device synchronisation.

    A Python float is rounded to fp32 as a C++ ``float`` parameter receives it; a CPU tensor for
    tensors elsewhere is read on the host, as amp_C reads it.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype != torch.float32 or value.device not in (
                device, torch.device("cpu")):
            raise ValueError(
                f"{op}: {name} must be a Python number or a 1-element float32 tensor on {device} or "
                f"the CPU, got a {value.dtype} tensor of {value.numel()} elements on {value.device}"
            )
        if value.device == device:
            return value.reshape(())
        value = value.item()
    return torch.full((), real(op, name, value), dtype=torch.float32, device=device)


def _refuse_step(op, value):
    """A step value as both implementations print it: an int as one, a float with 9 digits."""
    shown = str(value) if isinstance(value, int) else "nan" if math.isnan(value) else f"{value:.9g}"
    raise ValueError(f"{op}: step is the step number after this update, 1 to {MAX_ADAM_STEP}; got {shown}")


def step_number(op, step):
    """Rule 4 for lamb's step (and adam's as an int): a Python int from 1 to 2**31 - 1."""
    value = integer(op, "step", step)
    if not 1 <= value <= MAX_ADAM_STEP:
        _refuse_step(op, value)
    return value


def adam_step(op, step, device):
    """Adam's step as ``(step, valid)``: a 0-dim int64 tensor on ``device``, and None where the
    step was checked here (an int, a CPU tensor), else a 0-dim bool tensor on ``device`` saying
    whether it is in range, computed there without a host read (the step is then 1 where not)."""
    if not isinstance(step, torch.Tensor):
        return torch.full((), step_number(op, step), dtype=torch.int64, device=device), None
    if step.numel() != 1 or step.dtype not in _STEP_DTYPES or step.device != device:
        raise ValueError(
            f"{op}: step must be a Python int or a 1-element int32, int64 or float32 tensor on "
            f"{device}, got a {step.dtype} tensor of {step.numel()} elements on {step.device}"
        )
    step = step.reshape(())
    if storage.read_on_host(device):
        value = step.item()
        if not (1 <= value <= MAX_ADAM_STEP and value == math.floor(value)):
            _refuse_step(op, value)
        return torch.full((), int(value), dtype=torch.int64, device=device), None
    wide = step.double()  # compared in fp64, as the kernel does: fp32 would round 2**31 - 1 up
    valid = (wide >= 1) & (wide <= MAX_ADAM_STEP) & (wide == wide.trunc())
    return torch.where(valid, step, torch.ones_like(step)).to(torch.int64), valid


# ---- update_scale_hysteresis ------------------------------------------------------------------------


def check_state_tensor(op, name, t, dtype, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {_type_name(t)}")
    if t.numel() != 1 or t.dtype != dtype or t.device != device:
        raise ValueError(
            f"{op}: {name} must be a 1-element {dtype} tensor on {device} (the device of "
            f"current_scale), got a {t.dtype} tensor of {t.numel()} elements on {t.device}"
        )


def int32(op, name, value):
    value = integer(op, name, value)
    if not -(2**31) <= value <= INT32_MAX:
        raise ValueError(f"{op}: {name} must fit in int32 (the trackers' dtype), got {value}")
    return value


def scale_bound(op, name, value):
    """None, or a float an fp32 clamp can hold (an infinity, or within fp32's range)."""
    if value is None:
        return None
    bound = real(op, name, value)
    if not (abs(bound) == math.inf or abs(bound) <= FP32_MAX):
        raise ValueError(f"{op}: {name} must be None, inf or a number within fp32's range, got {value}")
    return bound
