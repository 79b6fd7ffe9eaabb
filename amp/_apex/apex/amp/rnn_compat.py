"""``apex.amp.rnn_compat``: Apex's indirection of ``torch.nn.modules.rnn._VF``, on amp's RNN patches.

``amp.init()`` (and ``amp.initialize`` at O1/O4) already casts every RNN and RNN cell
(``amp.casting.rnn``); these names serve code that does it by hand, as Apex's ``init`` did.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from amp._compat import rnn_module
from amp.casting import lists, rnn

from . import utils, wrap

__all__ = ["RNN_NAMES", "VariableFunctionsShim", "has_old_rnns", "whitelist_rnn_cells"]

_VF = torch._C._VariableFunctions
#: The RNN kernels ``torch.nn.modules.rnn`` calls through ``_VF`` (each with a ``<name>_cell``).
RNN_NAMES = list(lists.RNN_FUNCTIONS)


def _forward_to_vf(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(_VF, name)(*args, **kwargs)
    call.__name__ = name
    return call


class VariableFunctionsShim:
    """An object with the RNN kernels and cells of ``_VF`` as attributes, each calling ``_VF``'s:
    put in place of ``torch.nn.modules.rnn._VF``, its entries can be patched without touching torch."""

    def __init__(self) -> None:
        for name in RNN_NAMES:
            for suffix in ("", "_cell"):
                setattr(self, name + suffix, _forward_to_vf(name + suffix))


def has_old_rnns() -> bool:
    """Whether PyTorch still has the pre-1.0 ``torch.nn.backends.thnn`` RNN backend: never today."""
    return hasattr(getattr(torch.nn, "backends", None), "thnn")


def whitelist_rnn_cells(handle: Any, verbose: bool) -> None:
    """Patch the RNN cells of ``torch.nn.modules.rnn._VF`` (through ``handle``) to run in fp16.

    ``_VF`` there must be a shim first (Apex's ``VariableFunctionsShim`` or the one ``amp.init()``
    installs), so that torch's own ``_VF`` is never patched.
    """
    module = rnn_module()
    if not isinstance(module._VF, (VariableFunctionsShim, rnn._VFShim)):
        raise RuntimeError("whitelist_rnn_cells patches the shim that stands for _VF in "
                           "torch.nn.modules.rnn: call amp.init() (or amp.initialize at O1) first, or "
                           "set torch.nn.modules.rnn._VF = VariableFunctionsShim().")
    for name in RNN_NAMES:
        wrap.cached_cast(module._VF, name + "_cell", utils.maybe_half, handle, try_caching=True, verbose=verbose)
