"""amp.loss_scale / loss_scale_tensor / loss_scaler: the public way to read and reset a scale."""
import pytest
import torch

import amp
from amp_common import initialized, train_step


def test_loss_scale_follows_overflows_of_the_latest_run_and_of_a_given_optimizer():
    model, optimizer = initialized("O2", num_losses=2)
    train_step(model, optimizer, 0, inject=True)
    other_model, other_optimizer = initialized("O1", seed=1)
    assert amp.loss_scale() == 2.0**16                        # the latest run: no overflow yet
    assert amp.loss_scale(optimizer=optimizer) == 2.0**15     # the first run's loss 0 halved
    assert amp.loss_scale(1, optimizer=optimizer) == 2.0**16  # its loss 1 untouched
    scale = amp.loss_scale_tensor(optimizer=optimizer)
    assert scale.dtype == torch.float32 and scale.dim() == 0 and scale.item() == 2.0**15
    train_step(model, optimizer, 1, inject=True)
    assert scale.item() == 2.0**15  # a copy: it does not follow later updates


def test_loss_scaler_resets_a_shrunken_scale():
    model, optimizer = initialized("O2")
    for step in range(3):
        train_step(model, optimizer, step, inject=True)
    amp.loss_scaler(optimizer=optimizer).set_scale(2.0**16)
    assert amp.loss_scale(optimizer=optimizer) == 2.0**16


@pytest.mark.parametrize("accessor", ["loss_scale", "loss_scale_tensor", "loss_scaler"])
def test_an_accessor_called_before_initialize_names_itself(accessor):
    with pytest.raises(RuntimeError, match=rf"amp\.{accessor}\(\) needs an enabled amp.initialize"):
        getattr(amp, accessor)()


def test_accessors_name_a_bad_loss_id_and_need_an_initialize():
    with pytest.raises(RuntimeError, match="needs an enabled amp.initialize"):
        amp.loss_scale()
    initialized("O2")
    for loss_id in (1, -1, True, "0"):
        with pytest.raises(IndexError, match="num_losses=1"):
            amp.loss_scale(loss_id)
