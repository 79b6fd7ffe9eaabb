"""A short timing of the fused unscale against what PyTorch offers for it, as a ratio.

The one number a bug report about speed needs first: fp16 gradients into fp32 master gradients
times 1/scale with the overflow check, as ``amp_C.multi_tensor_scale`` does in one pass, against
``_foreach_copy_`` followed by ``_amp_foreach_non_finite_check_and_unscale_`` (what a PyTorch user
writes). Interleaved repetitions, medians; both results are also compared bit for bit. It never
fails on speed (a shared machine's timings vary); ``benchmarks/unscale.py`` is the full benchmark.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, List

import torch

from amp import multi_tensor_apply as mta
from amp._compat import non_finite_check_and_unscale_

from .kernel_cases import AMP_CHUNK
from .kernels import skip_reason
from .report import FAIL, PASS, SKIP, Result, error_line

__all__ = ["unscale_timing"]


def _shapes(device: torch.device, quick: bool) -> List[int]:
    """A GPT-like mix: a few large matrices and many small vectors (elements per tensor)."""
    width = {("cpu", True): 192, ("cpu", False): 512}.get((device.type, quick), 1024 if quick else 2048)
    shapes = [8 * width * width]
    for _ in range(4):
        shapes += [width, width, 3 * width * width, 3 * width, width * width, width,
                   4 * width * width, 4 * width, 4 * width * width, width]
    return shapes


def seconds_per_call(fn: Callable[[], object], device: torch.device, inner: int = 10) -> float:
    """Seconds per call of ``fn``: CUDA events around ``inner`` back-to-back calls on a GPU (no host
    clock in the measured region), the host clock around one call on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / inner
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def unscale_timing(device: torch.device, quick: bool = False) -> Result:
    """Time amp_C's fused unscale against PyTorch's on ``device`` (a skip where amp_C is not used)."""
    name = "unscale timing"
    reason = skip_reason("multi_tensor_scale", device)
    if reason is not None:
        return Result(name, str(device), SKIP, reason)
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    grads = [(torch.randn(n, generator=gen) * 1024).half().to(device) for n in _shapes(device, quick)]
    ours = [torch.empty(g.shape, device=device) for g in grads]
    theirs = [torch.empty(g.shape, device=device) for g in grads]
    inv_scale = torch.full((1,), 1 / 1024, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    found_inf = torch.zeros(1, device=device)

    def fused() -> None:
        mta.amp_C.multi_tensor_scale(AMP_CHUNK, flag, [grads, ours], inv_scale)

    def pytorch() -> None:
        torch._foreach_copy_(theirs, grads)
        non_finite_check_and_unscale_(theirs, found_inf, inv_scale)

    reps, inner = (5, 5) if quick else (21, 10)
    times: List[List[float]] = [[], []]
    try:
        fused()  # warm-up
        pytorch()
        for _ in range(reps):
            for k, fn in enumerate((fused, pytorch)):
                times[k].append(seconds_per_call(fn, device, inner))
        equal = all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(ours, theirs))
        equal = equal and flag.item() == 0 and found_inf.item() == 0
    except Exception as err:  # noqa: BLE001 - any error is the finding, named in the report
        return Result(name, str(device), FAIL, f"raised {error_line(err)}", 1,
                      time.perf_counter() - start)
    seconds = time.perf_counter() - start
    elements = sum(g.numel() for g in grads)
    if not equal:
        return Result(name, str(device), FAIL, "amp_C's unscale and PyTorch's gave different bits or "
                      f"flags over {elements / 1e6:.1f}M elements", 1, seconds)
    ours_s, theirs_s = statistics.median(times[0]), statistics.median(times[1])
    ratio = theirs_s / ours_s
    return Result(name, str(device), PASS,
                  f"{len(grads)} fp16 grads ({elements / 1e6:.1f}M elements) -> fp32: amp_C "
                  f"{ours_s * 1e3:.2f} ms, _foreach_copy_ + _amp_foreach_non_finite_check_and_unscale_ "
                  f"{theirs_s * 1e3:.2f} ms: amp_C {ratio:.2f}x as fast (medians of {reps})",
                  1, seconds, ratio=ratio)
