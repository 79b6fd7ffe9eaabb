"""Casting the arguments of one call: the hot path shared by every wrapper.

The helpers walk the positional and keyword arguments once and allocate nothing when no argument
needs a cast, because they run on every patched call (every ``x + y`` under O1).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Sequence, Tuple

import torch
from torch import Tensor
from torch.nn import Parameter

from .._logging import logger
from .._compat import is_compiling

FLOATING = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
LOW_PRECISION = frozenset((torch.float16, torch.bfloat16))
TYPE_NAMES = {torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float",
              torch.float64: "Double"}
# Apex casts a list or tuple argument only when every element is a floating tensor (the RNN
# weight list, the tensors of cat); torch.Size and other tuple subclasses are never containers.
_SEQUENCES = (list, tuple)

#: ``cast(tensor, dtype)``: one cast, made by ``make_caster`` or a wrapper's policy caster.
Caster = Callable[[Tensor, torch.dtype], Tensor]
#: The O1/O4 weight-cast cache: fp32 Parameter -> (its low-precision copy, the Parameter's version).
CastCache = Dict[Parameter, Tuple[Tensor, int]]


def _all_floating(seq: Iterable[Any]) -> bool:
    for t in seq:
        if not isinstance(t, Tensor) or t.dtype not in FLOATING:
            return False
    return True


def _cast_sequence(seq: list[Tensor] | tuple[Tensor, ...], dtype: torch.dtype,
                   cast: Caster) -> list[Tensor] | tuple[Tensor, ...]:
    if all(t.dtype is dtype for t in seq):
        return seq
    return type(seq)(t if t.dtype is dtype else cast(t, dtype) for t in seq)


def cast_args(args: Sequence[Any], kwargs: dict[str, Any], dtype: torch.dtype,
              cast: Caster) -> tuple[Any, dict[str, Any]]:
    """Cast every floating tensor (or all-floating list/tuple) argument to ``dtype``.

    ``cast(tensor, dtype)`` performs one cast. Returns ``(args, kwargs)``; ``args`` is the input
    sequence itself when nothing changed, else a list (so typed ``Any``: callers rebind their
    ``*args`` tuple to it), and ``kwargs`` (the wrapper's own dict) is updated in place.
    """
    # The tensor test is inlined rather than shared with the kwargs loop: this loop runs for
    # every patched call and a helper call per argument is most of its cost.
    out = None
    i = 0
    for a in args:
        if isinstance(a, Tensor):
            d = a.dtype
            if d is not dtype and d in FLOATING:
                if out is None:
                    out = list(args)
                out[i] = cast(a, dtype)
        elif type(a) in _SEQUENCES and a and _all_floating(a):
            new = _cast_sequence(a, dtype, cast)
            if new is not a:
                if out is None:
                    out = list(args)
                out[i] = new
        i += 1
    if kwargs:
        for k, v in kwargs.items():
            if isinstance(v, Tensor):
                d = v.dtype
                if d is not dtype and d in FLOATING:
                    kwargs[k] = cast(v, dtype)
            elif type(v) in _SEQUENCES and v and _all_floating(v):
                kwargs[k] = _cast_sequence(v, dtype, cast)
    return (args if out is None else out), kwargs


def _promote(found: torch.dtype | None, d: torch.dtype) -> torch.dtype:
    return d if found is None or found is d else torch.promote_types(found, d)


def widest_type(values: Iterable[Any]) -> torch.dtype | None:
    """The promoted dtype of the floating tensors among ``values``, or None when they all agree.

    Any mix is promoted with torch's rules ({half, float} -> float, {float, double} -> double,
    {half, bfloat16} -> float), where Apex raised for anything but {half, float}.
    """
    found = None
    mixed = False
    for a in values:
        if isinstance(a, Tensor):
            d = a.dtype
            if d in FLOATING and d is not found:
                mixed = found is not None
                found = _promote(found, d)
        elif type(a) in _SEQUENCES and a and _all_floating(a):
            for t in a:
                if t.dtype is not found:
                    mixed = mixed or found is not None
                    found = _promote(found, t.dtype)
    return found if mixed else None


def no_floating_scalar(values: Iterable[Any]) -> bool:
    """True when no floating tensor among ``values`` is 0-dim (see lists.NATIVE_PROMOTE)."""
    for a in values:
        if isinstance(a, Tensor) and a.dim() == 0 and a.dtype in FLOATING:
            return False
    return True


def any_low_precision(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """True when any floating tensor argument (or list element) is fp16 or bf16."""
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, Tensor):
            if a.dtype in LOW_PRECISION:
                return True
        elif type(a) in _SEQUENCES:
            if any(isinstance(t, Tensor) and t.dtype in LOW_PRECISION for t in a):
                return True
    return False


def cast_tensor(t: Tensor, dtype: torch.dtype, name: str, verbose: bool = False,
                cache: CastCache | None = None) -> Tensor:
    """Cast ``t`` to ``dtype`` for the wrapper of function ``name``.

    With a ``cache`` dict (the handle's), fp32 Parameters cast to fp16/bf16 are cast once and the
    copy is shared by every use (one autograd node) until the cache is cleared. With
    ``verbose``, each inserted cast logs Apex's "Float->Half (name)" line to the ``amp`` logger
    at INFO.
    """
    # Under torch.compile the graph itself shares one cast per weight; a Python-side cache
    # there would only cost graph breaks.
    if (cache is None or t.dtype is not torch.float32 or dtype not in LOW_PRECISION
            or not isinstance(t, Parameter) or is_compiling()):
        return _plain_cast(t, dtype, name, verbose)
    # Keyed by the Parameter object, so the copy's autograd parent is always `t`: no need
    # for Apex's next_functions[1] parent check, which broke on torch >= 1.10 (Q7).
    entry = cache.get(t)
    version = t._version
    if entry is not None:
        copy, cached_version = entry
        # A copy made under no_grad cannot carry gradients in training (train -> eval ->
        # train), and an in-place update of the parameter (optimizer.step with no cache
        # clear in between) makes the copy stale: both are cast again.
        if (cached_version == version and copy.dtype is dtype
                and (copy.requires_grad == t.requires_grad or not torch.is_grad_enabled())):
            return copy
    copy = _plain_cast(t, dtype, name, verbose)
    # Inference tensors cannot be saved for backward later, so they are never cached.
    if not torch.is_inference_mode_enabled():
        cache[t] = (copy, version)
    return copy


def _plain_cast(t: Tensor, dtype: torch.dtype, name: str, verbose: bool) -> Tensor:
    if verbose:
        logger.info("%s->%s (%s)", TYPE_NAMES.get(t.dtype, t.dtype), TYPE_NAMES.get(dtype, dtype),
                    name)
    return t.to(dtype)


def make_caster(name: str, verbose: bool = False, cache: CastCache | None = None) -> Caster:
    """Return ``cast(tensor, dtype)``: ``cast_tensor`` bound to ``name``, ``verbose``, ``cache``."""
    def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
        return cast_tensor(t, dtype, name, verbose, cache)
    return cast
