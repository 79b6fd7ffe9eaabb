"""``apex.amp.lists.functional_overrides``: the O1 lists for ``torch.nn.functional``."""
import torch

from amp.casting import lists

from . import ReadOnlyList

_FUNCTIONAL = lists.overrides(torch.float16)[0]

MODULE = _FUNCTIONAL.module
FP16_FUNCS = ReadOnlyList(_FUNCTIONAL.low_precision)
FP32_FUNCS = ReadOnlyList(_FUNCTIONAL.fp32)
#: ``(name, the error amp raises for it with fp16 arguments)``.
BANNED_FUNCS = ReadOnlyList(_FUNCTIONAL.banned.items())

__all__ = ["MODULE", "FP16_FUNCS", "FP32_FUNCS", "BANNED_FUNCS"]
