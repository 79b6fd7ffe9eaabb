"""How many steps an optimizer skipped, kept on its device and readable on the host without a sync."""
from __future__ import annotations

import torch

__all__ = ["SkipCounts"]


class SkipCounts:
    """Skipped steps in all and in a row, and whether the last step was applied.

    The counts live in one float32 device tensor (exact up to 2**24 skips) updated by two device
    ops per step, so the sync-free path never waits for the device. The host still has to notice
    a run that skips forever: on CPU it reads the counts through a numpy view of the same memory;
    on CUDA each step enqueues a non-blocking copy into pinned memory, read only once the copy has
    finished (``Event.query`` never blocks), so it lags by a step. ``steps`` counts every step on the
    host; when ``host_values`` answers, its counts are those of the last of these ``steps``.
    """

    def __init__(self, device: torch.device) -> None:
        self.counts = torch.zeros(2, dtype=torch.float32, device=device)
        self._total, self._in_a_row = self.counts[0], self.counts[1]
        self._one = torch.ones((), dtype=torch.float32, device=device)
        self._zero = torch.zeros((), dtype=torch.float32, device=device)
        self.last_skipped = self._zero
        if device.type == "cuda":
            self._host = torch.zeros(2, dtype=torch.float32, pin_memory=True)
            self._event: torch.cuda.Event | None = torch.cuda.Event()
        else:
            self._host, self._event = self.counts, None
        self._host_view = self._host.numpy()
        self._pending = self._event is None
        self.steps = 0

    def record(self, skipped: torch.Tensor) -> None:
        """Count one step; ``skipped`` is a 0-dim float32 device tensor, 1.0 for a skipped step."""
        torch._foreach_add_([self._total, self._in_a_row], [skipped, self._one])
        self._in_a_row.mul_(skipped)
        self.last_skipped = skipped
        self.steps += 1
        if self._event is not None:
            self._host.copy_(self.counts, non_blocking=True)
            self._event.record()
            self._pending = True

    def record_known(self, skipped: bool) -> None:
        """Count one step whose outcome the host already knows (``skipped`` is a bool)."""
        self.record(self._one if skipped else self._zero)

    def record_applied(self) -> None:
        """A step that had no overflow check (static scale, or no scale_loss since the last one)."""
        self.last_skipped = self._zero
        self.steps += 1

    def host_values(self) -> tuple[int, int] | None:
        """``(skipped in all, skipped in a row)`` as ints, or None while the copy is in flight."""
        if not self._pending or (self._event is not None and not self._event.query()):
            return None
        self._pending = self._event is None
        return int(self._host_view[0]), int(self._host_view[1])

    def step_applied(self) -> torch.Tensor:
        """0-dim bool device tensor: was the last step applied?"""
        return self.last_skipped == 0

    def skipped_steps(self) -> torch.Tensor:
        """0-dim int64 device tensor: how many steps were skipped in all."""
        return self._total.to(torch.int64)
