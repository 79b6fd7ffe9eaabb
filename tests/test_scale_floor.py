"""A dynamic scale held at its floor by overflows that recur but never in a row: warned, then an error.

The scenario of issue 17: a steady 5 % overflow rate with growth_interval=200 never lets the scale
grow, so it sinks to the floor 2**-24, where fp16 gradients flush to zero and applied steps stop
changing the weights, while max_consecutive_skips never trips. backoff_factor=2**-8 brings the
scale from 2**16 to the floor in five overflows, so the run takes a fraction of a second.

At any floor (``min_loss_scale=1`` in Apex-era code) a skip rate that stays above what the scale's
own probing explains is warned about too (issue 29).
"""
import logging

import pytest

import amp
from amp._overflow_report import OverflowReporter
from amp.scaler import DEFAULT_MIN_LOSS_SCALE, LossScaler
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


# -- a sustained skip rate, whatever the floor ---------------------------------------------------

def skip_rate_messages(caplog):
    return [message for message in caplog.messages if "of the last" in message]


def train_overflowing(options, steps, overflows):
    """``steps`` steps of O2 (verbosity 1 unless ``options`` say); ``overflows(step, optimizer)``: inject?"""
    model, optimizer = initialized("O2", **dict(dict(verbosity=1), **options))
    for step in range(steps):
        train_step(model, optimizer, step, inject=overflows(step, optimizer))
    return optimizer


def every_other_step(step, optimizer):
    return step % 2 == 0


def above_2_to_the_10(step, optimizer):
    """The gradients overflow whenever the scale exceeds 2**10, as a model's real ones would."""
    return amp.loss_scale(optimizer=optimizer) > 2.0**10


def test_a_sustained_skip_rate_at_a_floor_of_one_is_warned_with_the_rate_and_the_remedy(caplog):
    # Every other step overflowing held the scale at min_loss_scale=1 and skipped half the steps
    # forever, while the floor watch (floors below 1 only) said nothing.
    with caplog.at_level(logging.WARNING, logger="amp"):
        optimizer = train_overflowing(dict(min_loss_scale=1.0), 200, every_other_step)
    assert amp.loss_scale(optimizer=optimizer) == 1.0
    [message] = skip_rate_messages(caplog)
    assert "skipped 50 of the last 100 steps (50.0%; 100 of 200 in all)" in message
    assert "hysteresis=1 time(s) per growth_interval=2000 clean steps" in message
    assert "hysteresis=2 or more" in message and "min_loss_scale=1.0" in message and "bfloat16" in message


def test_skip_rate_warnings_are_rate_limited_and_follow_verbosity(caplog):
    with caplog.at_level(logging.WARNING, logger="amp"):
        train_overflowing(dict(min_loss_scale=1.0), 450, every_other_step)
        assert [m.split(" in all")[0].split("; ")[1] for m in skip_rate_messages(caplog)] == [
            "100 of 200", "150 of 300", "200 of 400"]
        caplog.clear()
        train_overflowing(dict(min_loss_scale=1.0, verbosity=0), 300, every_other_step)
    assert skip_rate_messages(caplog) == []


@pytest.mark.parametrize("options", [dict(), dict(growth_interval=10), dict(growth_interval=10, hysteresis=2)],
                         ids=["default", "growth_interval_10", "hysteresis_2"])
def test_the_dynamic_scales_own_probing_and_settling_are_not_warned_about(caplog, options):
    # The scale settles from 2**16 to 2**10 in six skips in a row, then grows after growth_interval
    # clean steps and overflows hysteresis times to come back: with growth_interval=10 that is
    # 9% (18% with hysteresis=2) of the steps, for ever.
    with caplog.at_level(logging.WARNING, logger="amp"):
        optimizer = train_overflowing(options, 450, above_2_to_the_10)
    assert int(amp.skipped_steps(optimizer)) >= 6
    assert skip_rate_messages(caplog) == []


@pytest.mark.filterwarnings("ignore:amp. the dynamic loss scale fell")
def test_a_scale_held_at_a_floor_below_one_gets_the_floor_warning_only(caplog):
    with caplog.at_level(logging.WARNING, logger="amp"):
        train_overflowing(dict(SCENARIO, max_steps_at_scale_floor=0), 300, every_other_step)
    assert floor_messages(caplog) and skip_rate_messages(caplog) == []


class StepsOnTheHost:
    """``SkipCounts.steps`` as the reporter reads it."""

    steps = 0


@pytest.mark.parametrize("skip_every, warned", [(2, True), (25, False)])
def test_counts_learnt_late_and_unevenly_give_the_exact_rate(caplog, skip_every, warned):
    # On CUDA the host learns the counts only when their copy has landed: here at every 37th step
    # at first, then at irregular ones. Each window's rate is its skips over its steps.
    counts = StepsOnTheHost()
    reporter = OverflowReporter(0, scalers=[LossScaler("dynamic")], step_counts=counts)
    with caplog.at_level(logging.WARNING, logger="amp"):
        for counts.steps in [37, 74, 111, 148, 185, 222, 230, 301, 333, 340]:
            skips = counts.steps // skip_every
            reporter.report(skips, 0, lambda: "Gradient overflow.", list)
    messages = skip_rate_messages(caplog)
    assert bool(messages) == warned
    if warned:  # windows closed at 111, 222 and 333: the second and the third are warned about
        assert [m.split(" (")[0] for m in messages] == [
            "Gradient overflow skipped 56 of the last 111 steps", "Gradient overflow skipped 55 of the last 111 steps"]
