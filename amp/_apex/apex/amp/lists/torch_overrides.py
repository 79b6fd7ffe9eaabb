"""``apex.amp.lists.torch_overrides``: the O1 lists for ``torch``."""
import torch

from amp.casting import lists

from . import ReadOnlyList

_TORCH = lists.overrides(torch.float16)[1]

MODULE = _TORCH.module
FP16_FUNCS = ReadOnlyList(_TORCH.low_precision)
FP32_FUNCS = ReadOnlyList(_TORCH.fp32)
CASTS = ReadOnlyList(_TORCH.promote)
SEQUENCE_CASTS = ReadOnlyList(_TORCH.sequence_promote)

__all__ = ["MODULE", "FP16_FUNCS", "FP32_FUNCS", "CASTS", "SEQUENCE_CASTS"]
