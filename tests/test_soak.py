"""Soak: 3000 steps of a tiny O2 model with inf injected at seeded random steps.

The expected final scale is computed in plain Python from the injection schedule with Apex's
rule: an overflow halves the scale and resets the growth count; ``growth_interval`` clean steps
in a row double it, capped at ``max_loss_scale``.
"""
import random
import warnings

import torch
from torch import nn

import amp
from amp._amp_state import _amp_state
from amp_common import poison_grad

STEPS = 3000
INTERVAL = 40
MAX_SCALE = 2.0**20


def injection_schedule(seed=1234, probability=0.03):
    rng = random.Random(seed)
    return {step for step in range(STEPS) if rng.random() < probability}


def predicted_scales(injected):
    """(final scale, lowest scale) of the schedule."""
    scale, clean = 2.0**16, 0
    lowest = scale
    for step in range(STEPS):
        if step in injected:
            scale, clean = scale / 2, 0
            lowest = min(lowest, scale)
        else:
            clean += 1
            if clean == INTERVAL:
                scale, clean = min(scale * 2, MAX_SCALE), 0
    return scale, lowest


class Tiny(nn.Module):
    """Elementwise only: a CPU fp16 matmul costs milliseconds, a 3000-step soak must not."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return (x * self.weight).sum(dim=1) + self.bias


def test_soak_skips_exactly_the_injected_steps_and_ends_at_the_predicted_scale():
    injected = injection_schedule()
    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0, growth_interval=INTERVAL,
                                      max_loss_scale=MAX_SCALE)
    x = torch.randn(8, 3)
    final_scale, lowest_scale = predicted_scales(injected)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_soak(model, optimizer, x, injected)
    # Injections outpace growth in this schedule, so the scale drifts below 1, which warns once.
    below_one = [w for w in caught if "below 1.0" in str(w.message)]
    assert len(below_one) == (1 if lowest_scale < 1 else 0)
    assert not [w for w in caught if w not in below_one]
    # SGD never turns an inf or NaN parameter finite again, so finite at the end means finite throughout.
    assert all(bool(torch.isfinite(p).all()) for p in list(amp.master_params(optimizer)) + list(model.parameters()))
    assert int(amp.skipped_steps(optimizer)) == len(injected)
    assert _amp_state.loss_scalers[0].loss_scale() == final_scale


def run_soak(model, optimizer, x, injected):
    for step in range(STEPS):
        # Small enough that even the largest scale never overflows on its own: only injections skip.
        loss = model(x).pow(2).mean() * 1e-4
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
            if step in injected:
                poison_grad(model.weight, float("inf") if step % 2 else float("nan"))
        optimizer.step()
        optimizer.zero_grad()
