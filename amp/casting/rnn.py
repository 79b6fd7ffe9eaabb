"""Running nn.RNN / nn.GRU / nn.LSTM and the RNN cells in low precision.

``torch.nn.modules.rnn`` calls its kernels through the module global ``_VF`` (``_VF.lstm(...)``,
``_VF.gru_cell(...)``), so that global is replaced by a shim whose RNN entries are wrappers and
whose other attributes forward to the real ``torch._VF``; ``torch._VF`` itself is never touched.
The handle records the replacement, so ``_deactivate`` puts the real module back.
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Callable

import torch
from torch import Tensor

from .._compat import rnn_module
from . import lists, policy
from ._cast import FLOATING, cast_args
from .wrap import Function, make_cast_wrapper, make_policy_caster


class _VFShim:
    """Stands in for ``torch._VF`` inside ``torch.nn.modules.rnn``."""

    def __init__(self, vf: ModuleType) -> None:
        self._vf = vf

    def __getattr__(self, name: str) -> Any:
        return getattr(self._vf, name)


def _flat_cast(weights: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """Cast an RNN's weight list into views of one new buffer of ``dtype``.

    cuDNN wants all weights in one contiguous buffer in its own layout; when the fp32 weights
    already are (``flatten_parameters`` on CUDA) their offsets are kept, otherwise they are
    packed in order. Each view is filled with ``copy_``, so gradients flow back into the fp32
    weights.
    """
    if all(w.dtype is dtype for w in weights):
        return weights
    base = weights[0]
    storage_ptr = base.untyped_storage().data_ptr()
    if all(w.is_contiguous() and w.untyped_storage().data_ptr() == storage_ptr for w in weights):
        offsets = [w.storage_offset() for w in weights]
        size = base.untyped_storage().nbytes() // base.element_size()
    else:
        offsets, size = [], 0
        for w in weights:
            offsets.append(size)
            size += w.numel()
    flat = torch.empty(size, dtype=dtype, device=base.device)
    views = []
    for w, offset in zip(weights, offsets):
        view = flat[offset:offset + w.numel()].view_as(w)
        view.copy_(w)
        views.append(view)
    return views


def _make_rnn_wrapper(orig: Function, name: str) -> Function:
    cast = make_policy_caster(name)

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        run = policy.current
        if run is None or not run._is_active:
            return orig(*args, **kwargs)
        dtype = run.patch_type
        # (input, hx, weights, ...) or, for a PackedSequence, (data, batch_sizes, hx, weights, ...):
        # batch_sizes is the only integer tensor in either signature.
        packed = isinstance(args[1], Tensor) and args[1].dtype not in FLOATING
        w = 3 if packed else 2
        call_args = list(args)
        weights = _flat_cast(call_args[w], dtype)
        call_args[w] = []  # keep the weight list out of the generic cast below
        call_args, kwargs = cast_args(call_args, kwargs, dtype, cast)
        call_args[w] = weights
        return orig(*call_args, **kwargs)
    return wrapper


def _make_check_input_wrapper(orig: Function) -> Function:
    # RNNBase.check_input rejects an input whose dtype differs from the weights' unless
    # torch.autocast is on. Under amp the kernels get matching dtypes anyway, so the check is
    # run on a shape-only stand-in that carries the weights' dtype.
    @functools.wraps(orig)
    def check_input(self: torch.nn.RNNBase, input: Tensor, batch_sizes: Tensor | None) -> Any:
        # torch types the flat weights Optional; the first (weight_ih_l0) always exists.
        weight_dtype = self._flat_weights[0].dtype  # type: ignore[union-attr]
        run = policy.current
        active = run is not None and run._is_active
        if active and input.dtype is not weight_dtype and input.dtype in FLOATING:
            input = torch.empty(input.shape, dtype=weight_dtype, device="meta")
        return orig(self, input, batch_sizes)
    return check_input


def install(save_func: Callable[[Any, str, Any], None]) -> None:
    """Patch the RNN entry points of ``torch.nn.modules.rnn`` through ``save_func(owner, name, new)``,
    the handle's, which records each patch."""
    rnn = rnn_module()
    shim = _VFShim(rnn._VF)
    for name in lists.RNN_FUNCTIONS:
        if hasattr(shim, name):
            setattr(shim, name, _make_rnn_wrapper(getattr(shim, name), name))
    for name in lists.RNN_CELLS:
        if hasattr(shim, name):
            setattr(shim, name, make_cast_wrapper(getattr(shim, name), name, None,
                                                  try_caching=True))
    save_func(rnn, "_VF", shim)
    base = rnn.RNNBase
    save_func(base, "check_input", _make_check_input_wrapper(base.check_input))
