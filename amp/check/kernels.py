"""Self-test of each ``amp_C`` kernel against amp's PyTorch fallback, on one device.

Our CUDA kernels are compiled in CI but only ever run on the machines of the people who build
them, so this is where they are proven. Every case builds the same inputs twice, runs
``amp_C.<op>`` on one copy and ``amp._pytorch_ops.<op>`` (the fallback, whose arithmetic is the
contract) on the other, and compares every tensor afterwards: outputs, inputs (which must be
unchanged alike) and the overflow flag, bit for bit (NaN payloads aside); only the norms of the
l2norm family are compared within ``NORM_RTOL``, as they sum in another order.

The cases (``kernel_cases``) cross what the kernels' launchers cut; the comparison is
``kernel_compare``'s. ``first_use_test`` runs the few cases amp itself runs before it trusts
``amp_C`` on a device (``first_use``).
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from amp import _pytorch_ops
from amp import multi_tensor_apply as mta

from . import first_use
from .kernel_cases import CHUNK, cases
from .kernel_compare import NORM_RTOL, compare
from .report import FAIL, PASS, SKIP, Result

__all__ = ["NORM_RTOL", "CHUNK", "self_test", "first_use_test", "skip_reason"]


def skip_reason(op: str, device: torch.device) -> Optional[str]:
    """Why a check of ``amp_C.<op>`` on ``device`` is skipped (amp does not use it there), or None."""
    if mta.amp_C is None:
        return "amp_C is not built"  # the environment report says why, and how to build it
    path, reason = mta.path_for(op, device)
    return None if path == "amp_C" else f"amp runs the PyTorch fallback here ({reason})"


def first_use_test(device: torch.device) -> Result:
    """amp's first-use self-test (``amp.check.first_use``) on ``device``, as amp runs it before it
    uses ``amp_C`` there; a skip where amp does not use ``amp_C``."""
    reason = skip_reason("multi_tensor_scale", device)
    if reason is not None:
        return Result(first_use.CHECK, str(device), SKIP, reason)
    return first_use.self_test(mta.amp_C, device)


def self_test(op: str, device: torch.device, quick: bool = False) -> Result:
    """Compare ``amp_C.<op>`` with the fallback on ``device``; a skip where amp does not use
    ``amp_C`` there (the reason is ``amp.multi_tensor_apply.path_for``'s)."""
    start = time.perf_counter()
    reason = skip_reason(op, device)
    if reason is not None:
        return Result(op, str(device), SKIP, reason)
    kernel, fallback = getattr(mta.amp_C, op), getattr(_pytorch_ops, op)
    count, failures = 0, []
    for case in cases(op, device, quick):
        count += 1
        problem = compare(case, kernel, fallback)
        if problem is not None:
            failures.append(problem)
    seconds = time.perf_counter() - start
    if failures:
        more = f" (and {len(failures) - 1} more cases)" if len(failures) > 1 else ""
        return Result(op, str(device), FAIL, f"{len(failures)} of {count} cases differ; first: "
                      f"{failures[0]}{more}", count, seconds)
    how = f"norms within rtol {NORM_RTOL}, flag and tensors bit for bit" if "l2norm" in op else "bit for bit"
    return Result(op, str(device), PASS, f"amp_C equals the fallback: {how}", count, seconds)
