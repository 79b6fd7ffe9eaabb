"""``apex`` where NVIDIA Apex is not installed (``python -m amp.apex status`` says what answers).

Apex's own ``__init__`` imported its subpackages, so ``import apex; apex.parallel.SyncBatchNorm``
worked: here each is imported on first access (``import apex``, a probe many libraries make, stays
lighter than Apex's). Also the helpers Apex defined in this module.
"""
from __future__ import annotations

import importlib
import warnings
from types import ModuleType

import torch

# Apex's warning class and helper, which its fp16_utils used: ours are fp16_utils'.
from fp16_utils._deprecation import DeprecatedFeatureWarning, deprecated_warning  # noqa: F401

__all__ = ["amp", "fp16_utils", "normalization", "optimizers", "parallel"]


def __getattr__(name: str) -> ModuleType:
    if not name.startswith("__"):
        try:
            return importlib.import_module(f"apex.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"apex.{name}":
                raise
    raise AttributeError(f"module 'apex' has no attribute {name!r}")


def check_cudnn_version_and_warn(global_option: str, required_cudnn_version: int) -> bool:
    """Whether cuDNN is available at ``required_cudnn_version`` or later; warns naming
    ``global_option`` (the feature that needs it) when not."""
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if version is not None and version >= required_cudnn_version:
        return True
    found = "cuDNN is not available" if version is None else f"cuDNN {version} is"
    warnings.warn(f"`{global_option}` depends on cuDNN {required_cudnn_version} or later, but {found}")
    return False
