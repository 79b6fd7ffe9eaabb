"""What ``FusedAdam`` and ``FusedLAMB`` share: Adam's two moments per parameter, and Apex's one
step count per param group, a Python int that the host learns of a device-skipped step for late.

The step count of each param group, ``param_groups[i]["step"]``, is a Python int as in Apex (LR
schedulers read it): the steps applied so far. Parameters without a gradient are not updated and
their state is untouched, but their group's count advances (Apex's rule; torch counts per
parameter). A step that amp or GradScaler skips on the device (``found_inf``) writes nothing, and
the host learns of the skip without waiting for the device: the count goes up when the step is
taken and comes back down when the flag reaches the host, the step being skipped. On the CPU that
is at once; on a GPU the flag is copied to the host behind the step's kernels and read when it is
next needed, which only waits for that copy, never for later work: at the next ``step()``,
``state_dict()`` or ``amp.scale_loss`` exit (so an LR scheduler that reads the count after the
backward, as NVIDIA's BERT scripts do, sees a skipped step uncounted, as under Apex). Only a read
between a skipped GPU step and the next of these sees it counted; the arithmetic never does. The
step that creates a group's state under such a flag reads the flag on the host once, so that a
skipped first step leaves no state behind.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ._fused import Bucket, BucketKey, FusedOptimizer, Params, check_real

__all__ = ["MomentsOptimizer", "check_moment_options", "moment_lists", "step_count", "check_step_count",
           "MAX_STEP_COUNT"]

# The step numbers the kernels take end at 2**31 - 1: a count of steps taken, one less.
MAX_STEP_COUNT = 2**31 - 2


class MomentsOptimizer(FusedOptimizer):
    """Base of ``FusedAdam`` and ``FusedLAMB`` (not public): the moments and the group step counts."""

    def __init__(self, params: Params, defaults: dict[str, Any], materialize_master_grads: bool,
                 set_grad_none: bool) -> None:
        super().__init__(params, defaults, materialize_master_grads, set_grad_none)
        self._reset_step_bookkeeping()

    def _reset_step_bookkeeping(self) -> None:
        # The last step's skip flag on its way to the host, and the counts the running step set.
        self._pending_skip: _PendingSkip | None = None
        self._counted: list[tuple[dict[str, Any], int]] = []

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._reset_step_bookkeeping()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        self._settle_step_counts()
        self._counted = []
        result = super().step(closure)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and self._counted:
            self._pending_skip = _PendingSkip(found_inf, self._counted)
            if found_inf.device.type == "cpu":
                self._settle_step_counts()  # free on the CPU: the count is exact at once
        return result

    def _settle_step_counts(self) -> None:
        """Take back the counts of the last step if the device skipped it (see the module doc)."""
        pending, self._pending_skip = self._pending_skip, None
        if pending is not None and pending.skipped():
            for group, counted in pending.groups:
                if group.get("step") == counted:  # unless something wrote another count since
                    group["step"] = counted - 1

    def state_dict(self) -> dict[str, Any]:
        """As torch's, with every count settled."""
        self._settle_step_counts()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, with every group's count checked before anything is loaded."""
        self._settle_step_counts()
        super().load_state_dict(self._checked_state(state_dict))

    def _checked_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` as this optimizer loads it (a new dict), checked; refuses with ValueError."""
        groups = []
        for index, group in enumerate(state_dict.get("param_groups", ())):
            check_step_count(type(self).__name__, group.get("step"), index)
            groups.append({**group, "step": step_count(group["step"])} if "step" in group else group)
        return {**state_dict, "param_groups": groups}

    def __getstate__(self) -> dict[str, Any]:
        self._settle_step_counts()
        return super().__getstate__()

    def _begin_group_step(self, group: dict[str, Any], buckets: dict[BucketKey, Bucket],
                          found_inf: torch.Tensor | None) -> int | None:
        """Make the moments of the group's new parameters and count the step; returns the step
        number, or None for a first step that may be skipped and is (nothing changes)."""
        fresh = [param for bucket in buckets.values() for param in bucket.params
                 if "exp_avg" not in self.state[param]]
        if fresh and found_inf is not None and found_inf.item():
            return None  # a skipped step that would create state: nothing may change (the one host read)
        step = step_count(group.get("step", 0)) + 1
        for param in fresh:
            state = self.state[param]
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        group["step"] = step
        self._counted.append((group, step))
        return step


def check_moment_options(lr: float, eps: float, weight_decay: float, betas: Any) -> None:
    """Raise ``ValueError`` naming the first of Adam's options out of range."""
    check_real("learning rate", lr, 0.0)
    check_real("epsilon value", eps, 0.0)
    check_real("weight_decay value", weight_decay, 0.0)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r}; expected a pair of numbers in [0, 1).")
    check_real("beta parameter at index 0", betas[0], 0.0, 1.0, high_open=True)
    check_real("beta parameter at index 1", betas[1], 0.0, 1.0, high_open=True)


def moment_lists(state: Any, bucket: Bucket) -> list[list[torch.Tensor]]:
    """``[grads, params, exp_avgs, exp_avg_sqs(, model_copies)]`` of a bucket, as the ops take them
    (with remainders ``[grads, weights, exp_avgs, exp_avg_sqs, remainders]``)."""
    states = [state[param] for param in bucket.params]
    return bucket.op_lists([[s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]])


class _PendingSkip:
    """A step's skip flag on its way to the host, and the counts that step set (group, count)."""

    def __init__(self, found_inf: torch.Tensor, groups: list[tuple[dict[str, Any], int]]) -> None:
        self.groups = groups
        flag = found_inf.detach().reshape(1).to(torch.float32)
        if flag.device.type == "cpu":
            self._host, self._copied = flag, None
        else:
            # Behind the step's kernels in the stream; waiting for it waits for nothing later.
            self._host = torch.empty(1, dtype=torch.float32, pin_memory=True)
            self._host.copy_(flag, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def skipped(self) -> bool:
        if self._copied is not None:
            self._copied.synchronize()
        # Through numpy: memory on the host, read without asking the device anything.
        return bool(self._host.numpy()[0] != 0)


def step_count(step: Any) -> int:
    """A count checked by ``check_step_count`` (an int, a whole float or a 1-element tensor) as an int."""
    return int(step.item() if isinstance(step, torch.Tensor) else step)


def check_step_count(optimizer: str, step: Any, index: int) -> None:
    """A loaded step count (the steps taken so far: a number, or a 1-element tensor, read once
    here) must be a whole number from 0 to 2**31 - 2, so that the next step number is one that
    the kernels take."""
    if step is None:
        return
    value = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value == math.floor(value) and 0 <= value <= MAX_STEP_COUNT):
        raise ValueError(f"{optimizer}.load_state_dict: param group {index} has the step count {step!r}; "
                         f"a step count is a whole number from 0 to {MAX_STEP_COUNT} (the steps taken)")
