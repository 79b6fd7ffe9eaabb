"""An fp32 master held as its bf16 model weight plus remainders (``master_weights="remainder"``).

The master has no fp32 storage of its own: ``weight`` (the model's bf16 param) and ``remainders``
(``amp._pytorch_ops.remainder``) hold its bits. amp's fused optimizers (``FusedAdam``, ``FusedSGD``)
step weight and remainders in one pass and never read the master. Anything else that uses it,
a ``torch.optim`` optimizer, a clip of ``amp.master_params``, a checkpoint hook, works on it as
on an fp32 tensor: each operation rebuilds the fp32 value first and, if the operation writes the
master in place, splits the result back into weight and remainders. The bits are those of an fp32
master; the cost is a rebuild (and a split) per operation, where an fp32 master costs nothing.

A view of a master (``view``, ``[...]``, ``t()``; ``detach`` and ``.data`` aside, which give the
master again) would be a view of a rebuilt copy, where a write would be lost: it raises, and
``master.clone()`` gives the fp32 value to view.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import increment_version
from torch.utils._pytree import tree_leaves, tree_map

from ._pytorch_ops import remainder

__all__ = ["RemainderMaster", "plain_value"]

_aten = torch.ops.aten
# Operations that read only the master's shape, dtype and device: no rebuild.
_SHAPE_ONLY = (_aten.zeros_like.default, _aten.empty_like.default, _aten.ones_like.default,
               _aten.full_like.default, _aten.new_zeros.default, _aten.new_empty.default)
# Another tensor object for the same master (nn.Parameter and ``.data`` need these to stay masters).
_ALIASES = (_aten.detach.default, _aten.alias.default)


class RemainderMaster(torch.Tensor):
    """The fp32 master of ``weight`` (a bf16 tensor) whose low bits are ``remainders``."""

    weight: torch.Tensor
    remainders: torch.Tensor

    @staticmethod
    def __new__(cls, weight: torch.Tensor, remainders: torch.Tensor) -> RemainderMaster:
        master = torch.Tensor._make_wrapper_subclass(
            cls, weight.shape, strides=weight.stride(), dtype=torch.float32, device=weight.device)
        master.weight, master.remainders = weight, remainders
        return master

    @classmethod
    def of(cls, weight: torch.Tensor, value: torch.Tensor) -> RemainderMaster:
        """The master of ``weight`` whose fp32 value is ``value`` (``weight`` is set to its rounding)."""
        master = cls(weight, remainder.new_remainders(weight.numel(), weight.device))
        master.store(value)
        return master

    def value(self) -> torch.Tensor:
        """The master's fp32 value, a new plain tensor laid out as the weight."""
        with torch.no_grad():
            return remainder.rebuild(self._checked_weight(), self.remainders)

    def store(self, value: torch.Tensor) -> None:
        """Make ``value`` (fp32, laid out as the weight) the master: split into weight and remainders.

        The remainders' version counts the write even here, where writes made inside
        ``__torch_dispatch__`` are not counted: amp tells its own writes from others' by it.
        """
        with torch.no_grad():
            remainder.split(value, self._checked_weight(), self.remainders)
        increment_version(self.remainders)

    def _checked_weight(self) -> torch.Tensor:
        """The weight, detached, once it is checked to be what the remainders belong to."""
        weight = self.weight.detach()
        if weight.dtype != torch.bfloat16 or weight.shape != self.shape or weight.stride() != self.stride():
            raise RuntimeError(
                f"The model parameter of an fp32 master kept as bf16 weight plus remainders "
                f"(master_weights='remainder') is now {weight.dtype} of shape {tuple(weight.shape)} and "
                f"strides {weight.stride()}, not bfloat16 of shape {tuple(self.shape)} and strides "
                f"{self.stride()} as amp.initialize left it (model.half(), .float() or .to(memory_format=...) "
                "after initialize?): its master cannot be rebuilt. Convert the model before amp.initialize.")
        return weight

    # Every operation reaches __torch_dispatch__, none runs as a Python-level override first.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _ALIASES:
            return cls(args[0].weight, args[0].remainders)
        written = _written_masters(func, args, kwargs)
        values: dict[int, tuple[RemainderMaster, torch.Tensor]] = {}

        def unwrap(leaf: Any) -> Any:
            if not isinstance(leaf, cls):
                return leaf
            if id(leaf) not in values:
                if func in _SHAPE_ONLY:
                    value = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device=leaf.device)
                else:
                    value = leaf.value()
                values[id(leaf)] = (leaf, value)
            return values[id(leaf)][1]

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        _refuse_views(func, out, [value for master, value in values.values() if id(master) not in written])
        for master, value in values.values():
            if id(master) in written:
                master.store(value)
        masters_of = {id(value): master for master, value in values.values()}
        return tree_map(lambda leaf: masters_of.get(id(leaf), leaf), out)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"RemainderMaster({self.value()!r})"


def _refuse_views(func: Any, out: Any, read_values: list[torch.Tensor]) -> None:
    """Raise if an output of ``func`` views the rebuilt value of a master it did not write."""
    storages = {value.untyped_storage().data_ptr() for value in read_values if value.numel() > 0}
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.numel() > 0 and leaf.untyped_storage().data_ptr() in storages:
            raise RuntimeError(
                f"{func} would view an fp32 master that amp keeps as a bf16 weight plus remainders "
                "(amp.initialize(master_weights='remainder')): a write through the view would be lost. "
                "Take master.clone() (its fp32 value) and view that, or write the master itself in place.")


def _written_masters(func: Any, args: Any, kwargs: Any) -> set[int]:
    """The ids of the masters that ``func`` writes in place (its schema's mutable arguments)."""
    written: set[int] = set()
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        for leaf in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(leaf, RemainderMaster):
                written.add(id(leaf))
    return written


def plain_value(master: torch.Tensor) -> torch.Tensor:
    """A master's fp32 value as a plain tensor: rebuilt, or the master itself, detached."""
    if isinstance(master, RemainderMaster):
        return master.value()
    return master.detach()
