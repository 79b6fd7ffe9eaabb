"""A dynamic scale held at its floor by overflows that recur but never in a row: warned, then an error.

The scenario of issue 17: a steady 5 % overflow rate with growth_interval=200 never lets the scale
grow, so it sinks to the floor 2**-24, where fp16 gradients flush to zero and applied steps stop
changing the weights, while max_consecutive_skips never trips. backoff_factor=2**-8 brings the
scale from 2**16 to the floor in five overflows, so the run takes a fraction of a second.
"""
import logging

import pytest

import amp
from amp.scaler import DEFAULT_MIN_LOSS_SCALE
from amp_common import initialized, train_step

OVERFLOW_EVERY = 20  # 5 % of the steps
SCENARIO = dict(growth_interval=200, backoff_factor=2.0**-8, max_consecutive_skips=5, verbosity=1)
# The fifth overflow (step 80) takes 2**16 to 2**-24.
FLOOR_STEP = 4 * OVERFLOW_EVERY


def train(model, optimizer, steps):
    """Run ``steps`` steps of the scenario; returns how many completed."""
    for step in range(steps):
        train_step(model, optimizer, step, inject=step % OVERFLOW_EVERY == 0)
    return steps


def floor_messages(caplog):
    return [message for message in caplog.messages if "has sat at its floor" in message]


@pytest.mark.filterwarnings("ignore:amp. the dynamic loss scale fell")
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_scale_held_at_the_floor_raises_after_max_steps_at_scale_floor(opt_level):
    model, optimizer = initialized(opt_level, max_steps_at_scale_floor=10, **SCENARIO)
    completed = []
    with pytest.raises(amp.LossScaleFloorError, match=r"floor min_loss_scale=5\.96\d*e-08 for 11 step"):
        for step in range(FLOOR_STEP + 100):
            train_step(model, optimizer, step, inject=step % OVERFLOW_EVERY == 0)
            completed.append(step)
    assert amp.loss_scale(optimizer=optimizer) == DEFAULT_MIN_LOSS_SCALE
    # Steps FLOOR_STEP .. FLOOR_STEP + 9 are the ten allowed at the floor; the next one raises.
    assert completed[-1] == FLOOR_STEP + 9


@pytest.mark.filterwarnings("ignore:amp. the dynamic loss scale fell")
def test_the_floor_warning_names_the_scale_the_skip_rate_and_the_remedy(caplog):
    model, optimizer = initialized("O2", **SCENARIO)
    with caplog.at_level(logging.WARNING, logger="amp"):
        train(model, optimizer, FLOOR_STEP + 1)
    [message] = floor_messages(caplog)
    assert "min_loss_scale=5.960464477539063e-08 for 1 step(s)" in message
    assert "5 of 81 steps (6.2%) were skipped" in message
    assert "growth_interval=200" in message and "hysteresis=2" in message and "bfloat16" in message
    assert "max_steps_at_scale_floor=100" in message


@pytest.mark.filterwarnings("ignore:amp. the dynamic loss scale fell")
def test_floor_warnings_are_rate_limited_and_zero_disables_the_error(caplog):
    model, optimizer = initialized("O2", max_steps_at_scale_floor=0, **SCENARIO)
    with caplog.at_level(logging.WARNING, logger="amp"):
        train(model, optimizer, FLOOR_STEP + 250)
    # At the 1st, 101st and 201st step at the floor.
    assert [m.split(" for ")[1].split(" step")[0] for m in floor_messages(caplog)] == ["1", "101", "201"]


def test_a_scale_that_leaves_the_floor_restarts_the_count(caplog):
    model, optimizer = initialized("O2", max_steps_at_scale_floor=10, **SCENARIO)
    with pytest.warns(UserWarning, match="loss scale fell"):
        train(model, optimizer, FLOOR_STEP + 5)
    amp.loss_scaler(optimizer=optimizer).set_scale(1.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="amp"):
        for step in range(FLOOR_STEP + 5, FLOOR_STEP + 15):
            train_step(model, optimizer, step)  # clean: the scale stays at 1, past the bound of 10
    assert floor_messages(caplog) == []


@pytest.mark.filterwarnings("ignore:amp. the dynamic loss scale fell")
def test_a_floor_that_fp32_rounds_up_is_watched_too():
    model, optimizer = initialized("O2", min_loss_scale=1e-3, max_steps_at_scale_floor=2, **SCENARIO)
    with pytest.raises(amp.LossScaleFloorError, match="min_loss_scale=0.001 for 3 step"):
        train(model, optimizer, FLOOR_STEP)
    assert amp.loss_scale(optimizer=optimizer) > 1e-3  # the floor in fp32: 0.0010000000475


def test_a_floor_of_one_is_not_watched(caplog):
    model, optimizer = initialized("O2", min_loss_scale=1.0, max_steps_at_scale_floor=3, **SCENARIO)
    with caplog.at_level(logging.WARNING, logger="amp"):
        train(model, optimizer, FLOOR_STEP + 20)
    assert amp.loss_scale(optimizer=optimizer) == 1.0 and floor_messages(caplog) == []
