"""Layer norm and RMS norm with Apex's names, arguments and output dtypes, on torch's kernels.

Apex computed in fp32 for fp16/bf16 inputs inside one CUDA kernel and wrote the result in the
input's dtype (``FusedLayerNorm``) or the weight's (the ``Mixed`` forms). Here the tensors are
widened to fp32, ``torch.nn.functional.layer_norm`` / ``rms_norm`` (or, on a torch without
``rms_norm``, the same formula in plain ops) runs, and the result is rounded once into that
dtype; autograd gives the backward. ``memory_efficient`` (which tensor Apex's kernel kept for the
backward) is accepted and changes nothing in the results.

Apex's autograd functions (``FusedLayerNormAffineFunction`` ...) are kept for code that calls
their ``apply``, as Megatron-LM did.
"""
from __future__ import annotations

import functools
import numbers
import warnings
from typing import Any, Sequence, Union, cast

import torch
from torch import nn
from torch.nn import functional as F

from amp.casting import float_function

__all__ = ["FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm",
           "fused_layer_norm", "fused_layer_norm_affine", "mixed_dtype_fused_layer_norm_affine",
           "fused_rms_norm", "fused_rms_norm_affine", "mixed_dtype_fused_rms_norm_affine",
           "manual_rms_norm", "FusedLayerNormFunction", "FusedLayerNormAffineFunction",
           "FusedLayerNormAffineMixedDtypesFunction", "FusedRMSNormFunction", "FusedRMSNormAffineFunction",
           "FusedRMSNormAffineMixedDtypesFunction"]

#: What Apex took as ``normalized_shape``: an int (the last dimension) or the trailing dimensions.
ShapeLike = Union[int, Sequence[int], torch.Size]

def _shape(normalized_shape: ShapeLike) -> torch.Size:
    if isinstance(normalized_shape, numbers.Integral):  # numpy's ints too
        return torch.Size((int(normalized_shape),))
    return torch.Size(int(size) for size in cast(Sequence[int], normalized_shape))


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The operands' common dtype, at least fp32: fp16/bf16 are computed in fp32, as Apex's kernels did."""
    dtypes = [t.dtype for t in tensors if t is not None]
    return functools.reduce(torch.promote_types, dtypes, torch.float32)


def _widened(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


def _check_input(input: torch.Tensor, shape: torch.Size) -> None:
    if not isinstance(input, torch.Tensor) or not input.is_floating_point():
        raise TypeError(f"expected a floating-point input tensor, got "
                        f"{input.dtype if isinstance(input, torch.Tensor) else type(input).__name__}")
    if input.dim() < len(shape) or tuple(input.shape[input.dim() - len(shape):]) != tuple(shape):
        raise RuntimeError(f"Given normalized_shape={list(shape)}, expected input with shape "
                           f"[*, {', '.join(map(str, shape))}], but got input of size {list(input.shape)}")


def _layer_norm(input: torch.Tensor, normalized_shape: ShapeLike, weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    shape = _shape(normalized_shape)
    _check_input(input, shape)
    dtype = _compute_dtype(input, weight, bias)
    out = F.layer_norm(input.to(dtype), shape, _widened(weight, dtype), _widened(bias, dtype), eps)
    return out.to(out_dtype)


def _rms_norm(input: torch.Tensor, normalized_shape: ShapeLike, weight: torch.Tensor | None, eps: float,
              out_dtype: torch.dtype) -> torch.Tensor:
    shape = _shape(normalized_shape)
    _check_input(input, shape)
    dtype = _compute_dtype(input, weight)
    rms_norm = getattr(F, "rms_norm", None)  # torch >= 2.4
    if rms_norm is None:
        out = manual_rms_norm(input.to(dtype), shape, _widened(weight, dtype), eps)
    else:
        out = rms_norm(input.to(dtype), shape, _widened(weight, dtype), eps)
    return out.to(out_dtype)


def manual_rms_norm(input: torch.Tensor, normalized_shape: ShapeLike, weight: torch.Tensor | None,
                    eps: float) -> torch.Tensor:
    """``input / sqrt(mean(input**2) + eps) * weight`` over the trailing ``normalized_shape``, in
    plain ops (what torch's ``rms_norm`` computes; for a torch that has none)."""
    dims = tuple(range(-len(_shape(normalized_shape)), 0))
    out = input * torch.rsqrt(input.pow(2).mean(dims, keepdim=True) + eps)
    return out if weight is None else out * weight


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


# Each functional form runs in fp32 under O1/O4 (amp.float_function), as F.layer_norm does there.

@float_function
def fused_layer_norm_affine(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                            normalized_shape: ShapeLike, eps: float = 1e-6,
                            memory_efficient: bool = False) -> torch.Tensor:
    """Layer norm over the trailing ``normalized_shape`` with ``weight`` and ``bias``, in the input's dtype."""
    _check_flag("memory_efficient", memory_efficient)
    return _layer_norm(input, normalized_shape, weight, bias, eps, input.dtype)


@float_function
def fused_layer_norm(input: torch.Tensor, normalized_shape: ShapeLike, eps: float = 1e-6,
                     memory_efficient: bool = False) -> torch.Tensor:
    """Layer norm over the trailing ``normalized_shape`` without affine parameters, in the input's dtype."""
    _check_flag("memory_efficient", memory_efficient)
    return _layer_norm(input, normalized_shape, None, None, eps, input.dtype)


@float_function
def mixed_dtype_fused_layer_norm_affine(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                                        normalized_shape: ShapeLike, eps: float = 1e-6,
                                        memory_efficient: bool = False) -> torch.Tensor:
    """``fused_layer_norm_affine`` whose result has the weight's dtype (fp32 weights, fp16 input: fp32)."""
    _check_flag("memory_efficient", memory_efficient)
    return _layer_norm(input, normalized_shape, weight, bias, eps, weight.dtype)


@float_function
def fused_rms_norm_affine(input: torch.Tensor, weight: torch.Tensor, normalized_shape: ShapeLike,
                          eps: float = 1e-6, memory_efficient: bool = False) -> torch.Tensor:
    """RMS norm over the trailing ``normalized_shape`` scaled by ``weight``, in the input's dtype."""
    _check_flag("memory_efficient", memory_efficient)
    return _rms_norm(input, normalized_shape, weight, eps, input.dtype)


@float_function
def fused_rms_norm(input: torch.Tensor, normalized_shape: ShapeLike, eps: float = 1e-6,
                   memory_efficient: bool = False) -> torch.Tensor:
    """RMS norm over the trailing ``normalized_shape`` without a weight, in the input's dtype."""
    _check_flag("memory_efficient", memory_efficient)
    return _rms_norm(input, normalized_shape, None, eps, input.dtype)


@float_function
def mixed_dtype_fused_rms_norm_affine(input: torch.Tensor, weight: torch.Tensor, normalized_shape: ShapeLike,
                                      eps: float = 1e-6, memory_efficient: bool = False) -> torch.Tensor:
    """``fused_rms_norm_affine`` whose result has the weight's dtype."""
    _check_flag("memory_efficient", memory_efficient)
    return _rms_norm(input, normalized_shape, weight, eps, weight.dtype)


class FusedLayerNormAffineFunction:
    """Apex's autograd function: ``apply(input, weight, bias, normalized_shape, eps, memory_efficient=False)``."""

    apply = staticmethod(fused_layer_norm_affine)


class FusedLayerNormFunction:
    """Apex's autograd function: ``apply(input, normalized_shape, eps, memory_efficient=False)``."""

    apply = staticmethod(fused_layer_norm)


class FusedLayerNormAffineMixedDtypesFunction:
    """Apex's autograd function: ``apply(input, weight, bias, normalized_shape, eps, memory_efficient=False)``."""

    apply = staticmethod(mixed_dtype_fused_layer_norm_affine)


class FusedRMSNormAffineFunction:
    """Apex's autograd function: ``apply(input, weight, normalized_shape, eps, memory_efficient=False)``."""

    apply = staticmethod(fused_rms_norm_affine)


class FusedRMSNormFunction:
    """Apex's autograd function: ``apply(input, normalized_shape, eps, memory_efficient=False)``."""

    apply = staticmethod(fused_rms_norm)


class FusedRMSNormAffineMixedDtypesFunction:
    """Apex's autograd function: ``apply(input, weight, normalized_shape, eps, memory_efficient=False)``."""

    apply = staticmethod(mixed_dtype_fused_rms_norm_affine)


class FusedLayerNorm(nn.Module):
    """Layer normalization over the trailing ``normalized_shape`` (``nn.LayerNorm``'s math), with
    Apex's constructor; the result has the input's dtype.

    Args:
        normalized_shape (int or sequence of ints): the trailing dimensions normalized together.
        eps (float, default 1e-5): added to the variance.
        elementwise_affine (bool, default True): a learnable weight (ones) and bias (zeros).
        memory_efficient (bool, default False): accepted as Apex's; changes nothing here.
    """

    def __init__(self, normalized_shape: ShapeLike, eps: float = 1e-5, elementwise_affine: bool = True,
                 memory_efficient: bool = False) -> None:
        super().__init__()
        _check_flag("elementwise_affine", elementwise_affine)
        _check_flag("memory_efficient", memory_efficient)
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape))
            self.bias = nn.Parameter(torch.empty(self.normalized_shape))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.elementwise_affine:
            return fused_layer_norm_affine(input, self.weight, self.bias, self.normalized_shape, self.eps,
                                           self.memory_efficient)
        return fused_layer_norm(input, self.normalized_shape, self.eps, self.memory_efficient)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class FusedRMSNorm(nn.Module):
    """RMS normalization over the trailing ``normalized_shape``: ``x / sqrt(mean(x**2) + eps) *
    weight``, with Apex's constructor; the result has the input's dtype.

    Args:
        normalized_shape (int or sequence of ints): the trailing dimensions normalized together.
        eps (float, default 1e-5): added to the mean square.
        elementwise_affine (bool, default True): a learnable weight (ones).
        memory_efficient (bool, default False): accepted as Apex's; changes nothing here.
    """

    def __init__(self, normalized_shape: ShapeLike, eps: float = 1e-5, elementwise_affine: bool = True,
                 memory_efficient: bool = False) -> None:
        super().__init__()
        _check_flag("elementwise_affine", elementwise_affine)
        _check_flag("memory_efficient", memory_efficient)
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            nn.init.ones_(self.weight)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.elementwise_affine:
            return fused_rms_norm_affine(input, self.weight, self.normalized_shape, self.eps, self.memory_efficient)
        return fused_rms_norm(input, self.normalized_shape, self.eps, self.memory_efficient)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


def _check_mixed_options(cls: type, kwargs: dict[str, Any]) -> None:
    """Apex's ``Mixed`` layers always have a weight: ``elementwise_affine`` is warned about, and refused if False."""
    unknown = sorted(set(kwargs) - {"elementwise_affine"})
    if unknown:
        raise TypeError(f"{cls.__name__}() got unexpected keyword arguments {unknown}")
    if "elementwise_affine" in kwargs:
        warnings.warn(f"{cls.__name__} does not take `elementwise_affine`: it always has a weight",
                      stacklevel=3)
        if kwargs["elementwise_affine"] is not True:
            raise RuntimeError(f"{cls.__name__} does not support `elementwise_affine = False`; "
                               f"use {cls.__mro__[1].__name__}(..., elementwise_affine=False)")


class MixedFusedLayerNorm(FusedLayerNorm):
    """``FusedLayerNorm`` whose result has the parameters' dtype (Megatron's mixed-dtype layer norm)."""

    def __init__(self, normalized_shape: ShapeLike, eps: float = 1e-5, *, memory_efficient: bool = False,
                 **kwargs: Any) -> None:
        _check_mixed_options(type(self), kwargs)
        super().__init__(normalized_shape, eps, elementwise_affine=True, memory_efficient=memory_efficient)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return mixed_dtype_fused_layer_norm_affine(input, self.weight, self.bias, self.normalized_shape,
                                                   self.eps, self.memory_efficient)


class MixedFusedRMSNorm(FusedRMSNorm):
    """``FusedRMSNorm`` whose result has the weight's dtype (Megatron's mixed-dtype RMS norm)."""

    def __init__(self, normalized_shape: ShapeLike, eps: float = 1e-5, *, memory_efficient: bool = False,
                 **kwargs: Any) -> None:
        _check_mixed_options(type(self), kwargs)
        super().__init__(normalized_shape, eps, elementwise_affine=True, memory_efficient=memory_efficient)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return mixed_dtype_fused_rms_norm_affine(input, self.weight, self.normalized_shape, self.eps,
                                                 self.memory_efficient)
