"""The GPU's current stream and device, and a second GPU: what amp_C's own CUDA runtime must get right.

``amp_C`` links the CUDA runtime statically (see ``setup.py``), so a process holds two runtimes,
torch's and amp_C's. amp_C's binding takes the tensors' device from torch, makes it current with a
device guard and launches on torch's current stream of that device; these checks prove that on
the GPUs of this machine:

* ``current stream``, per GPU: a kernel queued on a side stream that torch made current, behind
  a long busy wait and a write of its input, must read that write (a launch on another stream
  would not wait for it), and the current device must be the same after the call as before;
* with two GPUs or more, the first two each with the other one current: amp's first-use
  self-test (every op) and an O2 training step (``amp.check.training``) on ``cuda:1`` while
  ``cuda:0`` is the current device, and the reverse. The stream check then also runs with the
  other GPU current.
"""
from __future__ import annotations

import time
from typing import List, Optional

import torch

from amp import multi_tensor_apply as mta

from . import first_use, training
from .kernel_cases import AMP_CHUNK
from .kernels import skip_reason
from .report import FAIL, PASS, SKIP, Result, error_line

__all__ = ["STREAM", "OTHER_CURRENT", "checks"]

STREAM = "current stream"
OTHER_CURRENT = "with the other GPU current"
# About 30 ms of a GPU's cycles: the side stream is still busy when amp_C's kernel is queued.
_BUSY_CYCLES = 50_000_000


def _other(device: torch.device, gpus: List[torch.device]) -> Optional[torch.device]:
    """The GPU made current while ``device`` is checked: the other of the first two, if any."""
    pair = gpus[:2]
    if len(pair) < 2 or device not in pair:
        return None
    return pair[1] if device == pair[0] else pair[0]


def stream_check(device: torch.device, current: torch.device) -> Result:
    """amp_C's scale on ``device``'s side stream, with ``current`` the current device."""
    reason = skip_reason("multi_tensor_scale", device)
    if reason is not None:
        return Result(STREAM, str(device), SKIP, reason)
    start = time.perf_counter()
    try:
        count = 3 * AMP_CHUNK + 5
        src = torch.zeros(count, dtype=torch.float16, device=device)
        dst = torch.zeros(count, dtype=torch.float32, device=device)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # makes side the current stream of device, and device current
            torch.cuda._sleep(_BUSY_CYCLES)
            src.fill_(3.0)
            with torch.cuda.device(current):  # side stays device's current stream
                before = torch.cuda.current_device()
                mta.amp_C.multi_tensor_scale(AMP_CHUNK, flag, [[src], [dst]], 0.5)
                after = torch.cuda.current_device()
        side.synchronize()
        wrong = int((dst != 1.5).sum().item())
    except Exception as err:  # noqa: BLE001 - any error is the finding, named in the report
        return Result(STREAM, str(device), FAIL, f"raised {error_line(err)}",
                      1, time.perf_counter() - start)
    seconds = time.perf_counter() - start
    if wrong:
        return Result(STREAM, str(device), FAIL, f"{wrong} of {count} outputs did not see the input written "
                      "just before on torch's current stream: amp_C launched on another stream", 1, seconds)
    if after != before:
        return Result(STREAM, str(device), FAIL, f"the current device was cuda:{before} before the call and "
                      f"cuda:{after} after it", 1, seconds)
    return Result(STREAM, str(device), PASS, f"amp_C ran on torch's current stream of {device} (a side "
                  f"stream) with cuda:{before} current, which it left current", 1, seconds)


def _with_current(result: Result, current: torch.device) -> Result:
    result.check = f"{result.check}, {OTHER_CURRENT}"
    result.detail = f"cuda:{current.index} current: {result.detail}"
    return result


def cross_device_checks(device: torch.device, current: torch.device) -> List[Result]:
    """The first-use self-test and an O2 step on ``device`` while ``current`` is the current device."""
    reason = skip_reason("multi_tensor_scale", device)
    if reason is not None:
        return [Result(f"{check}, {OTHER_CURRENT}", str(device), SKIP, reason)
                for check in (first_use.CHECK, "O2 step")]
    with torch.cuda.device(current):
        return [_with_current(first_use.self_test(mta.amp_C, device), current),
                _with_current(training.training_check("O2 step", device), current)]


def checks(device: torch.device, gpus: List[torch.device]) -> List[Result]:
    """This section's checks of ``device`` (none for the CPU); ``gpus``: every GPU being checked."""
    if device.type != "cuda":
        return []
    other = _other(device, gpus)
    results = [stream_check(device, other or device)]
    if other is not None:
        results += cross_device_checks(device, other)
    return results
