"""``apex.amp.lists``: Apex's O1 function lists, read from amp's own (``amp.casting.lists``).

Each of ``functional_overrides``, ``torch_overrides`` and ``tensor_overrides`` holds Apex's names
(``MODULE``, ``FP16_FUNCS``, ``FP32_FUNCS``, ...), resolved against this PyTorch as amp's O1
patches resolve them. Apex-era code read these lists, and some edited them before ``amp.init()``
to change what is patched: amp does not read them, so they refuse to be edited (with the
``amp.register_*_function`` call that does it) rather than change nothing.
"""
from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["ReadOnlyList"]


class ReadOnlyList(tuple):
    """A tuple (it reads as Apex's list) whose list methods say how to change amp's lists instead."""

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            "apex.amp.lists are read-only copies of amp's O1 lists: editing them would change nothing "
            "amp patches. Use amp.register_half_function(module, name), "
            "amp.register_float_function(module, name) or amp.register_promote_function(module, "
            "name) before amp.initialize (or amp.init) instead.")

    append = extend = insert = remove = pop = clear = sort = reverse = _refuse
    __iadd__ = __imul__ = __setitem__ = __delitem__ = _refuse
