"""Helpers for hand-written mixed-precision training: converting networks to a low-precision
dtype while keeping batch norm in fp32, and keeping fp32 master copies of low-precision params."""
from __future__ import annotations

from typing import Any, Iterable, NoReturn, Sequence, TypeVar

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.modules.batchnorm import _BatchNorm

# Shared with amp.initialize; re-exported here, where Apex had them.
from amp._master_weights import (  # noqa: F401
    LOW_PRECISION_DTYPES,
    check_module,
    check_param_dtypes,
    convert_module,
    convert_network,
    swap_in_fp32_masters,
)

from ._deprecation import deprecated_warning

_M = TypeVar("_M", bound=nn.Module)

__all__ = [
    "tofp16",
    "BN_convert_float",
    "network_to_half",
    "convert_module",
    "convert_network",
    "FP16Model",
    "prep_param_lists",
    "model_grads_to_master_grads",
    "master_params_to_model_params",
    "to_python_float",
    "clip_grad_norm",
    "backwards_debug_hook",
    "TORCH_MAJOR",
    "TORCH_MINOR",
]


def _check_flag(value: object, name: str, where: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be True or False, got {value!r}.")


def _check_param_pairs(model_params: Iterable[torch.Tensor], master_params: Iterable[torch.Tensor],
                       flat_master: bool, where: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    _check_flag(flat_master, "flat_master", where)
    models, masters = list(model_params), list(master_params)
    if flat_master:
        if len(masters) != 1:
            raise ValueError(f"{where}: with flat_master=True, master_params must hold the single "
                             f"flat master from prep_param_lists(model, flat_master=True), got "
                             f"{len(masters)} tensors.")
        numel = sum(p.numel() for p in models)
        if masters[0].numel() != numel:
            raise ValueError(f"{where}: the flat master has {masters[0].numel()} elements but "
                             f"the model params have {numel}; pass the lists prep_param_lists returned.")
    elif len(models) != len(masters):
        raise ValueError(f"{where}: got {len(models)} model params but {len(masters)} "
                         "master params; pass the two lists prep_param_lists returned.")
    return models, masters


class tofp16(nn.Module):
    """A layer that casts its input to half, used as the first layer by ``network_to_half``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"tofp16 expects a tensor input, got {type(input).__name__}.")
        return input.half()


def BN_convert_float(module: _M) -> _M:
    """Cast every affine batch norm inside ``module`` back to fp32 (its statistics need the range)."""
    check_module(module, "BN_convert_float")
    for m in module.modules():
        if isinstance(m, _BatchNorm) and m.affine:
            m.float()
    return module


def network_to_half(network: nn.Module) -> nn.Sequential:
    """Legacy: ``nn.Sequential(tofp16(), network.half())`` with affine batch norm kept in fp32.

    Prefer ``FP16Model`` or ``convert_network``, which also keep the batch-norm buffers in fp32.
    """
    check_module(network, "network_to_half")
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


class FP16Model(nn.Module):
    """Wrap ``network`` converted by ``convert_network(network, dtype)``; ``forward`` casts its
    floating-point inputs to ``dtype`` (integer inputs such as token ids pass through unchanged).

    ``dtype`` is torch.float16 (Apex's only choice) or torch.bfloat16.
    """

    def __init__(self, network: nn.Module, *, dtype: torch.dtype = torch.float16) -> None:
        deprecated_warning("apex.fp16_utils is deprecated and will be removed. "
                           "Use amp.initialize with opt_level='O2' (or 'O5' for bfloat16) instead.")
        super().__init__()
        check_module(network, "FP16Model")
        if dtype not in LOW_PRECISION_DTYPES:
            raise TypeError(f"FP16Model: dtype must be torch.float16 or torch.bfloat16, got {dtype!r}.")
        self.dtype = dtype
        self.network = convert_network(network, dtype)

    def forward(self, *inputs: torch.Tensor) -> Any:
        cast = []
        for i, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"FP16Model.forward takes tensors only; input {i} is a "
                                f"{type(t).__name__}. Call the wrapped .network directly for other inputs.")
            cast.append(t.to(self.dtype) if t.is_floating_point() else t)
        return self.network(*cast)


def prep_param_lists(model: nn.Module,
                     flat_master: bool = False) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Return ``(model_params, master_params)``: the params of ``model`` that require grad, and
    fp32 copies of them (one flat fp32 Parameter with ``flat_master=True``) for the optimizer."""
    check_module(model, "prep_param_lists")
    _check_flag(flat_master, "flat_master", "prep_param_lists")
    model_params = [p for p in model.parameters() if p.requires_grad]
    check_param_dtypes(model_params, "prep_param_lists")
    if not model_params:
        raise ValueError("prep_param_lists: the model has no parameters with requires_grad=True, "
                         "so there is nothing to keep fp32 master copies of.")
    if flat_master:
        devices = {p.device for p in model_params}
        if len(devices) > 1:
            raise ValueError(f"prep_param_lists: flat_master=True needs every param on one device, "
                             f"found {sorted(str(d) for d in devices)}; use flat_master=False.")
        flat = _flatten_dense_tensors([p.detach() for p in model_params]).float()
        master = nn.Parameter(flat)
        master.grad = torch.zeros_like(master)
        return model_params, [master]
    master_params = [nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in model_params]
    return model_params, master_params


def model_grads_to_master_grads(model_params: Iterable[torch.Tensor], master_params: Iterable[torch.Tensor],
                                flat_master: bool = False) -> None:
    """Copy the model grads into the fp32 master grads (a model param without a grad leaves its
    master without one). The copy does not unscale: divide by the loss scale afterwards."""
    where = "model_grads_to_master_grads"
    model_params, master_params = _check_param_pairs(model_params, master_params, flat_master, where)
    if flat_master:
        missing = [i for i, p in enumerate(model_params) if p.grad is None]
        if missing:
            raise ValueError(f"{where}: with flat_master=True every model param needs a grad, but "
                             f"params {missing} have none; run backward first or use flat_master=False.")
        master = master_params[0]
        if master.grad is None:
            master.grad = torch.empty_like(master)
        master.grad.copy_(_flatten_dense_tensors([p.grad for p in model_params]))
        return
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        master.grad.copy_(model.grad)


def master_params_to_model_params(model_params: Iterable[torch.Tensor], master_params: Iterable[torch.Tensor],
                                  flat_master: bool = False) -> None:
    """Copy the fp32 masters into the model params, rounding to the model's dtype."""
    where = "master_params_to_model_params"
    model_params, master_params = _check_param_pairs(model_params, master_params, flat_master, where)
    if flat_master:
        master_params = _unflatten_dense_tensors(master_params[0].detach(), model_params)
    with torch.no_grad():
        for model, master in zip(model_params, master_params):
            model.copy_(master)


def to_python_float(t: torch.Tensor | Sequence[float]) -> float:
    """``t.item()`` for tensors; ``t[0]`` for the one-element sequences old code passed."""
    if hasattr(t, "item"):
        return t.item()
    return t[0]


clip_grad_norm = torch.nn.utils.clip_grad_norm_

#: torch's major and minor version numbers, which Apex's module held for its version checks.
TORCH_MAJOR, TORCH_MINOR = (int(part) for part in torch.__version__.split(".")[:2])


def backwards_debug_hook(grad: torch.Tensor) -> NoReturn:
    """``tensor.register_hook(backwards_debug_hook)`` on a tensor that must never get a gradient
    (Apex's debugging aid for flat fp32 masters): raises when one arrives."""
    raise RuntimeError("master_params received a gradient in the backward pass!")
