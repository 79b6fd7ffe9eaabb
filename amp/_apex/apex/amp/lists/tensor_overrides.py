"""``apex.amp.lists.tensor_overrides``: the O1 lists for ``torch.Tensor`` methods (the ``torch``
names that are also methods included, as in Apex)."""
import torch

from amp.casting import lists

from . import ReadOnlyList

_TENSOR = lists.overrides(torch.float16)[2]

MODULE = _TENSOR.module
FP16_FUNCS = ReadOnlyList(_TENSOR.low_precision)
FP32_FUNCS = ReadOnlyList(_TENSOR.fp32)
CASTS = ReadOnlyList(_TENSOR.promote)
SEQUENCE_CASTS = ReadOnlyList(_TENSOR.sequence_promote)

__all__ = ["MODULE", "FP16_FUNCS", "FP32_FUNCS", "CASTS", "SEQUENCE_CASTS"]
