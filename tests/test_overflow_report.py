"""Overflow that never ends: NonFiniteGradientsError, rate-limited skip messages, verbosity=0, and
overflow that keeps coming back (never consecutive, so never an error) without collapsing the scale."""
import logging

import pytest
import torch

import amp
from amp._amp_state import _amp_state
from amp.scaler import DEFAULT_MIN_LOSS_SCALE
from amp_common import batch, initialized, loss_of, net, sgd, train_step


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
    assert "amp.loss_scaler(0, optimizer=optimizer).set_scale(2.**16)" in message


def test_endless_overflow_names_a_parameter_no_model_names_by_its_position():
    # A low-precision parameter given to the optimizer after initialize has an fp32 master but no
    # name; the error used to fail on it with a TypeError (the master's name was None).
    model, optimizer = initialized("O2", max_consecutive_skips=2)
    extra = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    optimizer.add_param_group({"params": [extra]})
    with pytest.raises(amp.NonFiniteGradientsError, match=r"not finite: <parameter \d+ of the optimizer>"):
        for step in range(3):
            loss = loss_of(model(batch(step))) + (extra.float() * float("nan")).sum()
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            optimizer.zero_grad()


def test_a_clean_step_resets_the_consecutive_skip_count():
    model, optimizer = initialized("O1", max_consecutive_skips=2)
    for step, inject in enumerate([True, True, False, True, True, False]):
        train_step(model, optimizer, step, inject=inject)
    assert int(amp.skipped_steps(optimizer)) == 4


@pytest.mark.filterwarnings("ignore:amp. the dynamic loss scale fell")
def test_zero_max_consecutive_skips_disables_the_error():
    model, optimizer = initialized("O1", max_consecutive_skips=0)
    for step in range(60):
        train_step(model, optimizer, step, inject=True)
    assert int(amp.skipped_steps(optimizer)) == 60


@pytest.mark.filterwarnings("ignore:amp. the dynamic loss scale fell")
def test_skip_messages_are_rate_limited_warnings_of_the_amp_logger(caplog, capsys):
    model, optimizer = initialized("O2", max_consecutive_skips=0, max_steps_at_scale_floor=0, verbosity=1)
    with caplog.at_level(logging.WARNING, logger="amp"):
        for step in range(250):
            train_step(model, optimizer, step, inject=True)
    lines = caplog.messages
    assert 3 <= len(lines) <= 15
    assert {record.levelno for record in caplog.records} == {logging.WARNING}
    assert lines[0].startswith("Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to")
    assert capsys.readouterr().out == ""


def test_verbosity_zero_logs_nothing_at_all(caplog, capsys):
    model, optimizer = initialized("O2", verbosity=0, max_consecutive_skips=0)
    with caplog.at_level(logging.DEBUG, logger="amp"):
        for step in range(20):
            train_step(model, optimizer, step, inject=step % 2 == 0)
    assert caplog.records == [] and capsys.readouterr().out == ""


def test_a_later_initialize_does_not_silence_an_earlier_runs_skip_messages(caplog):
    model, optimizer = initialized("O2", verbosity=1)
    initialized("O2", seed=1, verbosity=0)
    with caplog.at_level(logging.WARNING, logger="amp"):
        train_step(model, optimizer, 0, inject=True)
    assert caplog.messages and caplog.messages[0].startswith("Gradient overflow.")


ALTERNATING_STEPS = 600  # 300 overflows: without a floor 2**16 halves past fp32's smallest denormal


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_overflow_on_every_other_step_stops_at_the_floor_with_finite_weights(opt_level):
    model, optimizer = initialized(opt_level, max_consecutive_skips=5, max_steps_at_scale_floor=0)
    with pytest.warns(UserWarning, match="loss scale fell to 0.5"):
        for step in range(ALTERNATING_STEPS):
            train_step(model, optimizer, step, inject=step % 2 == 0)
    assert _amp_state.loss_scalers[0].get_scale() == DEFAULT_MIN_LOSS_SCALE
    assert int(amp.skipped_steps(optimizer)) == ALTERNATING_STEPS // 2
    for param in list(model.parameters()) + list(amp.master_params(optimizer)):
        assert torch.isfinite(param).all()


@pytest.mark.filterwarnings("ignore:amp. the dynamic loss scale fell")
def test_overflow_on_every_other_step_equals_fp32_training_on_the_clean_steps():
    # An fp32 model scaled by powers of two is exact, so the applied steps must match plain fp32
    # SGD on the same batches bit for bit, at every scale down to the floor.
    model, optimizer = initialized("O0", loss_scale="dynamic", max_consecutive_skips=5,
                                   max_steps_at_scale_floor=0)
    reference = net()
    reference_optimizer = sgd(reference.parameters())
    for step in range(ALTERNATING_STEPS):
        train_step(model, optimizer, step, inject=step % 2 == 0)
        if step % 2:
            loss_of(reference(batch(step))).backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
    assert _amp_state.loss_scalers[0].get_scale() == DEFAULT_MIN_LOSS_SCALE
    for param, expected in zip(model.parameters(), reference.parameters()):
        assert torch.equal(param, expected)
