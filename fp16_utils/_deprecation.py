"""The deprecation warning that Apex's legacy mixed-precision entry points emitted."""
from __future__ import annotations

import warnings

import torch.distributed as dist

__all__ = ["DeprecatedFeatureWarning", "deprecated_warning"]


class DeprecatedFeatureWarning(FutureWarning):
    """Emitted by the legacy ``fp16_utils`` entry points that Apex had already deprecated.

    A ``FutureWarning`` subclass, as in Apex, so that it is shown by default and users can
    silence exactly this category with ``warnings.simplefilter("ignore", DeprecatedFeatureWarning)``.
    """


def deprecated_warning(msg: str) -> None:
    # Only rank 0 warns, so a multi-process job prints the notice once rather than once per rank.
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    warnings.warn(msg, DeprecatedFeatureWarning, stacklevel=3)
