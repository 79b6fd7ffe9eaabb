"""Overflow that never ends: NonFiniteGradientsError, rate-limited skip messages, verbosity=0."""
import pytest

import amp
from amp_common import fresh_amp, initialized, train_step  # noqa: F401


def test_endless_overflow_raises_naming_the_first_non_finite_parameters():
    model, optimizer = initialized("O2", max_consecutive_skips=5)
    for step in range(5):
        train_step(model, optimizer, step, inject=True)
    with pytest.raises(amp.NonFiniteGradientsError) as error:
        train_step(model, optimizer, 5, inject=True)
    message = str(error.value)
    assert "fc1.weight" in message
    assert "6 consecutive steps" in message and "max_consecutive_skips=5" in message
    assert "NaN or inf in the forward pass" in message


def test_a_clean_step_resets_the_consecutive_skip_count():
    model, optimizer = initialized("O1", max_consecutive_skips=2)
    for step, inject in enumerate([True, True, False, True, True, False]):
        train_step(model, optimizer, step, inject=inject)
    assert int(amp.skipped_steps(optimizer)) == 4


def test_zero_max_consecutive_skips_disables_the_error():
    model, optimizer = initialized("O1", max_consecutive_skips=0)
    for step in range(60):
        train_step(model, optimizer, step, inject=True)
    assert int(amp.skipped_steps(optimizer)) == 60


def test_skip_messages_are_rate_limited(capsys):
    model, optimizer = initialized("O2", max_consecutive_skips=0, verbosity=1)
    capsys.readouterr()
    for step in range(250):
        train_step(model, optimizer, step, inject=True)
    lines = capsys.readouterr().out.splitlines()
    assert 3 <= len(lines) <= 15
    assert lines[0].startswith("Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to")


def test_verbosity_zero_prints_nothing_at_all(capsys):
    model, optimizer = initialized("O2", verbosity=0, max_consecutive_skips=0)
    for step in range(20):
        train_step(model, optimizer, step, inject=step % 2 == 0)
    assert capsys.readouterr().out == ""
