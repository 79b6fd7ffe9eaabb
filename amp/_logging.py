"""amp's diagnostics: the ``amp`` logger, the rank-zero test, ``maybe_print`` and ``warn_at_caller``.

Everything amp reports goes through ``logging.getLogger("amp")`` (configuration at INFO, skipped
steps at WARNING), so applications can filter or redirect it; ``verbosity=0`` silences it. Misuse
that training survives is a warning instead, shown at the user's line. This module sits below
every other one of amp and imports none of them.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from types import FrameType
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["logger", "is_rank_zero", "maybe_print", "follow_verbosity", "warn_at_caller"]

# Frames in these directories are amp's or torch's own (a module's __call__, a compile wrapper).
_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
                 os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)

logger = logging.getLogger("amp")

# Where a message that belongs to no run finds the verbosity of the latest ``amp.initialize``
# (``_amp_state`` points it at its own field; see ``follow_verbosity``).
_latest_verbosity: Callable[[], int] = lambda: 1


def is_rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def follow_verbosity(latest: Callable[[], int]) -> None:
    """Make ``latest`` what ``maybe_print`` reads when it is given no verbosity."""
    global _latest_verbosity
    _latest_verbosity = latest


def maybe_print(msg: str, rank0: bool = False, verbosity: int | None = None) -> None:
    """Log ``msg`` at INFO to the ``amp`` logger unless verbosity is 0 (with ``rank0``, only on rank 0).

    ``verbosity`` defaults to the latest ``initialize``'s.
    """
    verbosity = _latest_verbosity() if verbosity is None else verbosity
    if verbosity > 0 and (not rank0 or is_rank_zero()):
        logger.info(msg)


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)``, shown at the innermost line outside amp and torch: the
    user's call (``optimizer.step()``, ``model(x)``) however deep amp's code and torch's wrappers are."""
    frame: FrameType | None = sys._getframe(1)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
