"""fp32 master weights: converting a network to fp16/bf16 with batch norm kept in fp32, and
swapping fp32 masters into an optimizer in place of its low-precision params.

``amp.initialize`` (O2/O5) and ``fp16_utils`` (``FP16_Optimizer``, ``fp16util``) share these;
``fp16_utils`` imports them from here, never the other way round.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from ._optimizer_wrappers import OptimizerLike

__all__ = [
    "LOW_PRECISION_DTYPES",
    "check_module",
    "check_param_dtypes",
    "check_trainable_dtype",
    "convert_module",
    "convert_network",
    "master_params",
    "swap_in_fp32_masters",
]

LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)
# Params of these dtypes may be managed: low-precision ones get fp32 masters, fp32 ones are their own.
SUPPORTED_PARAM_DTYPES = LOW_PRECISION_DTYPES + (torch.float32,)

_M = TypeVar("_M", bound=nn.Module)


def check_param_dtypes(params: Iterable[object], where: str) -> None:
    """Raise ``TypeError`` unless every param is a tensor of a dtype that fp32 masters can serve."""
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{where}: parameter {i} is a {type(p).__name__}, not a tensor; "
                            "pass the model's parameters (e.g. model.parameters()).")
        if p.dtype not in SUPPORTED_PARAM_DTYPES:
            raise TypeError(
                f"{where}: parameter {i} (shape {tuple(p.shape)}) has dtype {p.dtype}; wrapped "
                "parameters must be torch.float16 or torch.bfloat16 (they get fp32 master copies) "
                "or torch.float32 (kept as they are). Convert the model first, e.g. with "
                "convert_network(model, torch.float16).")


def check_trainable_dtype(param: torch.Tensor, name: str) -> None:
    """amp's form of the rule above: reject a param it cannot train, naming it (``name``) and the fix."""
    if param.dtype in SUPPORTED_PARAM_DTYPES:
        return
    if param.is_complex() or param.dtype == torch.float64:
        raise TypeError(
            f"Parameter {name} has dtype {param.dtype}: amp trains float32 models in fp16 or "
            "bf16 and would silently drop precision (or the imaginary part). Make it float32 "
            "first (model.float() before amp.initialize), or train it without amp.")
    raise TypeError(f"Parameter {name} has dtype {param.dtype}: optimizer parameters must be "
                    "floating point (torch.float32, torch.float16 or torch.bfloat16).")


def swap_in_fp32_masters(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], exact_fp32: dict[int, torch.Tensor] | None = None,
    make_master: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Replace each fp16/bf16 param of ``group`` by an fp32 master, in place.

    Frozen params get masters too, and frozen fp32 params are kept: a param unfrozen later must
    still have its grad unscaled and be stepped in fp32. The master takes the param's slot in
    ``group["params"]`` and its optimizer state, so the optimizer steps the master from then on.
    Its value is ``exact_fp32[id(param)]`` when given (amp passes the values from before the
    model was cast), else the param's own, widened; ``make_master(param, value)`` makes the master
    (default: ``nn.Parameter(value)``). Non-floating params, which can never have a grad, are left out. Returns ``(low-precision params, their masters, other params kept as
    they are)``.
    """
    exact_fp32 = exact_fp32 or {}
    low_precision: list[torch.Tensor] = []
    masters: list[torch.Tensor] = []
    kept: list[torch.Tensor] = []
    for index, param in enumerate(group["params"]):
        if not (param.requires_grad or param.is_floating_point()):
            continue
        if param.dtype in LOW_PRECISION_DTYPES:
            value = exact_fp32.get(id(param))
            value = value if value is not None else param.detach().to(torch.float32, copy=True)
            master = nn.Parameter(value) if make_master is None else make_master(param, value)
            group["params"][index] = master
            if param in optimizer.state:
                optimizer.state[master] = optimizer.state.pop(param)
            low_precision.append(param)
            masters.append(master)
        else:
            kept.append(param)
    return low_precision, masters, kept


def check_module(module: object, where: str) -> None:
    """Raise ``TypeError`` naming ``where`` unless ``module`` is an ``nn.Module``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{where} expects a torch.nn.Module, got {type(module).__name__}.")


def _check_float_dtype(dtype: object, where: str) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{where}: dtype must be a floating-point torch.dtype such as "
                        f"torch.float16 or torch.bfloat16, got {dtype!r}.")


def convert_module(module: _M, dtype: torch.dtype) -> _M:
    """Convert the floating-point params, grads and buffers of ``module`` itself (not its
    children) to ``dtype``, keeping the Parameter objects so optimizers still hold them."""
    check_module(module, "convert_module")
    _check_float_dtype(dtype, "convert_module")
    for param in module.parameters(recurse=False):
        if param.dtype.is_floating_point:
            param.data = param.data.to(dtype)
        if param._grad is not None and param._grad.dtype.is_floating_point:
            param._grad.data = param._grad.data.to(dtype)
    for buf in module.buffers(recurse=False):
        if buf.dtype.is_floating_point:
            buf.data = buf.data.to(dtype)
    return module


def convert_network(network: _M, dtype: torch.dtype) -> _M:
    """Convert ``network`` to ``dtype`` in place, except affine batch norm, which stays fp32.

    Non-affine batch norm is converted, running statistics included, as Apex did.
    """
    check_module(network, "convert_network")
    _check_float_dtype(dtype, "convert_network")
    for module in network.modules():
        if isinstance(module, _BatchNorm) and module.affine:
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


def master_params(optimizer: OptimizerLike) -> Iterator[torch.Tensor]:
    """Yield every parameter the optimizer steps: the fp32 masters under O2/O5.

    Clip gradients and read optimizer-side values through these, not ``model.parameters()``:
    under master weights the model's own low-precision ``.grad`` stay scaled. An ``amp.optimizers``
    optimizer with ``materialize_master_grads=False`` keeps no fp32 master grads; between
    ``scale_loss`` and ``step`` this makes them, for that step, so that clipping them works as in Apex
    (the masters of a list kept from an earlier call hold grads that raise when read).
    """
    stash = getattr(optimizer, "_amp_stash", None)
    if stash is not None:
        stash.prepare_master_grads()
    for group in optimizer.param_groups:
        yield from group["params"]
