"""``apex.amp.compat``: Apex's helpers for telling PyTorch versions apart.

Every PyTorch amp supports is past the Tensor/Variable merge (0.4), so they answer for that world.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Iterable

import torch

__all__ = ["variable_is_tensor", "tensor_is_variable", "tensor_is_float_tensor", "is_tensor_like",
           "is_floating_point", "scalar_python_val", "filter_attrs"]


def variable_is_tensor() -> bool:
    """Whether a Variable is a Tensor: True since PyTorch 0.4."""
    return isinstance(torch.autograd.Variable(torch.empty(0)), torch.Tensor)


def tensor_is_variable() -> bool:
    """Whether ``torch.Tensor()`` makes a Variable: False since PyTorch 0.4."""
    return type(torch.empty(0)) is torch.autograd.Variable


def tensor_is_float_tensor() -> bool:
    """Whether ``torch.Tensor()`` makes a ``torch.FloatTensor`` instance: False since PyTorch 0.4."""
    return type(torch.empty(0)) is torch.FloatTensor


def is_tensor_like(x: Any) -> bool:
    return torch.is_tensor(x)


def is_floating_point(x: Any) -> bool:
    """Whether ``x`` is a floating-point tensor (False for anything else)."""
    return torch.is_tensor(x) and torch.is_floating_point(x)


def scalar_python_val(x: Any) -> Any:
    """The Python number held by a one-element tensor (or by the first element of a sequence)."""
    return x.item() if hasattr(x, "item") else x[0]


def filter_attrs(module: ModuleType | type, attrs: Iterable[str]) -> list[str]:
    """The names among ``attrs`` that ``module`` has, in order."""
    return [name for name in attrs if hasattr(module, name)]
