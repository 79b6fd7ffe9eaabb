"""``apex.parallel.distributed``: ``DistributedDataParallel``, ``Reducer`` and ``flat_dist_call``
(``amp.parallel.distributed``), and the other helpers Apex's module held, on torch's flatten."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from amp.parallel.distributed import (
    DistributedDataParallel,
    Reducer,
    extract_tensors,
    flat_dist_call,
    split_by_type,
)

__all__ = ["DistributedDataParallel", "Reducer", "flat_dist_call", "apply_flat_dist_call",
           "split_by_type", "split_half_float_double", "extract_tensors", "flatten", "unflatten",
           "import_flatten_impl", "imported_flatten_impl"]

#: Apex flattened with its ``apex_C`` extension when built, else with torch: here always torch.
imported_flatten_impl = True


def import_flatten_impl() -> None:
    """Apex chose its flatten implementation here; torch's is always the one, chosen already."""


def flatten(bucket: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors of ``bucket`` (one dtype) laid end to end in one new 1-D tensor."""
    return _flatten_dense_tensors(bucket)


def unflatten(coalesced: torch.Tensor, bucket: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Views of ``coalesced`` shaped as the tensors of ``bucket``."""
    return _unflatten_dense_tensors(coalesced, bucket)


def apply_flat_dist_call(bucket: Sequence[torch.Tensor], call: Callable[..., Any],
                         extra_args: Sequence[Any] | None = None) -> None:
    """Apex's single-type step of ``flat_dist_call``; a bucket of several types is handled too."""
    flat_dist_call(bucket, call, extra_args)


def split_half_float_double(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The fp16, fp32 and fp64 tensors, in that order, as non-empty lists; others are left out."""
    tensors = list(tensors)
    buckets = [[t for t in tensors if t.dtype == dtype]
               for dtype in (torch.float16, torch.float32, torch.float64)]
    return [bucket for bucket in buckets if bucket]
