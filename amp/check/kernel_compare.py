"""How ``amp.check.kernels`` compares ``amp_C`` with the PyTorch fallback on one case.

A case builds the same inputs on every call and runs one op on them; it is run once with the
kernel and once with the fallback, and every tensor it saw is compared afterwards: outputs, inputs
(which must be unchanged alike) and the overflow flag, bit for bit (NaN payloads aside); only the
norms the l2norm family returns are compared within ``NORM_RTOL``, as they sum in another order.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from amp import _pytorch_ops

from .report import error_line

__all__ = ["NORM_RTOL", "Observation", "Op", "Case", "call", "compare", "dtype_name"]

# The documented agreement of the l2norm family with the fallback (docs/reference.md, "Check your
# installation"): relative, on every norm; non-finite norms and the flag must agree exactly.
NORM_RTOL = 1e-5

# What a case leaves to compare: (name, tensor, exact). ``exact=False`` means within NORM_RTOL.
Observation = Tuple[str, torch.Tensor, bool]
Op = Callable[..., Any]


@dataclasses.dataclass
class Case:
    """One comparison: ``run(op)`` builds fresh inputs (the same on every call), runs ``op`` on
    them and returns what to compare."""

    label: str
    run: Callable[[Op], List[Observation]]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
         torch.float64: torch.int64}


def _show(t: torch.Tensor, i: int) -> str:
    value = t[i].item()
    if t.dtype in _BITS:
        bits = int(t[i].view(_BITS[t.dtype]).item()) & ((1 << (8 * t.element_size())) - 1)
        return f"{value!r} (0x{bits:0{2 * t.element_size()}x})"
    return repr(value)


def _difference(name: str, ours: torch.Tensor, theirs: torch.Tensor, exact: bool) -> Optional[str]:
    """None when ``ours`` (amp_C) agrees with ``theirs`` (fallback), else the first difference."""
    if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
        return (f"{name} is {dtype_name(ours.dtype)}{list(ours.shape)} with amp_C but "
                f"{dtype_name(theirs.dtype)}{list(theirs.shape)} with the fallback")
    a, b = ours.detach().reshape(-1), theirs.detach().reshape(-1)
    if exact and a.dtype in _BITS and torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype])):
        return None  # the same bits, NaN payloads included: the usual case, decided in one call
    a, b = a.cpu(), b.cpu()
    if a.dtype in _BITS:
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        if exact:
            # Same bits, -0.0 and +0.0 told apart; NaN only by position (payloads may differ).
            differ = (nan_a != nan_b) | (~nan_a & (a.view(_BITS[a.dtype]) != b.view(_BITS[b.dtype])))
        else:
            finite = torch.isfinite(a) & torch.isfinite(b)
            far = (a.double() - b.double()).abs() > NORM_RTOL * b.double().abs()
            differ = (nan_a != nan_b) | (torch.isinf(a) != torch.isinf(b)) | (finite & far)
            differ |= ~finite & ~nan_a & ~nan_b & (a != b)  # an inf of the other sign
    else:
        differ = a != b
    if not bool(differ.any()):
        return None
    i = int(differ.nonzero()[0, 0])
    where = f"{name}[{i}]" if a.numel() > 1 else name
    tolerance = "" if exact else f" (beyond rtol {NORM_RTOL})"
    return f"{where} is {_show(a, i)} with amp_C but {_show(b, i)} with the fallback{tolerance}"


def _observe(names: Sequence[str], args: Sequence[Any], returned: Any) -> List[Observation]:
    """Every tensor in the call's arguments (bit for bit) and in what it returned (norms: within
    NORM_RTOL), named as the fallback's signature names them."""
    seen: List[Observation] = []

    def walk(name: str, value: Any, exact: bool) -> None:
        if isinstance(value, torch.Tensor):
            seen.append((name, value, exact))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{name}[{i}]", item, exact)

    for name, value in zip(names, args):
        walk(name, value, True)
    walk("returned", returned, False)
    return seen


def call(op_name: str, make: Callable[[], Tuple[Any, ...]]) -> Callable[[Op], List[Observation]]:
    """A case's ``run`` for one call of the op on the arguments ``make()`` builds."""
    names = list(inspect.signature(getattr(_pytorch_ops, op_name)).parameters)

    def run(op: Op) -> List[Observation]:
        args = make()
        returned = op(*args)
        return _observe(names, args, returned)
    return run


def compare(case: Case, kernel: Op, fallback: Op) -> Optional[str]:
    """None when the kernel agrees with the fallback on ``case``, else what went wrong."""
    results = []
    for who, op in (("amp_C", kernel), ("the fallback", fallback)):
        try:
            observed = case.run(op)
            if observed and observed[0][1].is_cuda:
                torch.cuda.synchronize(observed[0][1].device)  # a launch failure surfaces here
        except Exception as err:  # noqa: BLE001 - any error is the finding, named in the report
            return f"{case.label}: {who} raised {error_line(err)}"
        results.append(observed)
    ours, theirs = results
    if [name for name, _, _ in ours] != [name for name, _, _ in theirs]:
        return f"{case.label}: amp_C returned other tensors than the fallback"
    for (name, a, exact), (_, b, _) in zip(ours, theirs):
        difference = _difference(name, a, b, exact)
        if difference is not None:
            return f"{case.label}: {difference}"
    return None
