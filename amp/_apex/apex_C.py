"""``apex_C`` for Apex-era scripts where no extension is built (the drop-in switch on, no NVIDIA
Apex installed): Apex's ``flatten`` and ``unflatten``, which were torch's own dense-tensor
flattening bound in C++ (NVIDIA's BERT pretraining calls ``apex_C.unflatten(flat, grads)``)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["flatten", "unflatten"]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors (of one dtype and device) laid end to end in one new 1-D tensor."""
    return _flatten_dense_tensors(tensors)


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped as ``tensors``, in order; ``flat`` holds exactly their elements."""
    total = sum(t.numel() for t in tensors)
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"apex_C.unflatten: flat must be a 1-D tensor of the {total} elements of "
                         f"the tensors, got shape {list(flat.shape)}.")
    return list(_unflatten_dense_tensors(flat, tensors))
