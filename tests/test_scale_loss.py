"""amp.scale_loss: scaling, unscaling into master grads, accumulation, delays, loss ids, exception safety.

Exact references: O0 with a dynamic (power-of-two) scale keeps the model fp32, and scaling by a
power of two and unscaling by its inverse is exact, so its grads equal plain fp32 grads bit for bit.
"""
import pytest
import torch

import amp
from amp._amp_state import _amp_state
from amp_common import (TOLERANCES, assert_identical, batch, initialized, loss_of, net,
                        poison_grad, sgd)


def fp32_grads(steps, seed=0):
    """Plain fp32 grads of ``Net`` accumulated over the batches of ``steps``."""
    model = net(seed)
    for step in steps:
        loss_of(model(batch(step))).backward()
    return [p.grad for p in model.parameters()]


def backward(model, optimizer, step, **kwargs):
    with amp.scale_loss(loss_of(model(batch(step))), optimizer, **kwargs) as scaled_loss:
        scaled_loss.backward()


def test_scaled_loss_is_the_fp32_loss_times_the_scale():
    model, optimizer = initialized("O2")
    loss = loss_of(model(batch(0))).half()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        assert scaled_loss.dtype == torch.float32
        assert scaled_loss.item() == loss.float().item() * 2.0**16
        scaled_loss.backward()


def test_dynamic_o0_grads_equal_the_fp32_reference_exactly():
    model, optimizer = initialized("O0", loss_scale="dynamic")
    backward(model, optimizer, 0)
    assert_identical([p.grad for p in model.parameters()], fp32_grads([0]))


def test_o2_master_grads_are_the_unscaled_fp16_grads():
    model, optimizer = initialized("O2")
    backward(model, optimizer, 0)
    for param, master in zip(optimizer._amp_stash.all_fp16_params, optimizer._amp_stash.all_fp32_from_fp16_params):
        assert torch.equal(master.grad, param.grad.float() / 2.0**16)
    torch.testing.assert_close([p.grad for p in amp.master_params(optimizer)], fp32_grads([0]),
                               **TOLERANCES[torch.float16])


@pytest.mark.parametrize("opt_level", ["O0", "O2"])
def test_accumulation_over_two_backward_passes_loses_nothing(opt_level):
    # O2 with cast_model_type=False keeps fp32 params, so its sum is exact too.
    model, optimizer = initialized(opt_level, loss_scale="dynamic", cast_model_type=False)
    backward(model, optimizer, 0)
    backward(model, optimizer, 1)
    assert_identical([p.grad for p in amp.master_params(optimizer)], fp32_grads([0, 1]))


@pytest.mark.parametrize("opt_level", ["O0", "O2"])
def test_delay_unscale_accumulates_scaled_grads_and_unscales_once(opt_level):
    model, optimizer = initialized(opt_level, loss_scale="dynamic", cast_model_type=False)
    backward(model, optimizer, 0, delay_unscale=True)
    assert optimizer._amp_stash.params_have_scaled_gradients
    assert torch.equal(model.fc1.weight.grad, fp32_grads([0])[0] * 2.0**16)
    backward(model, optimizer, 1)
    assert not optimizer._amp_stash.params_have_scaled_gradients
    assert_identical([p.grad for p in amp.master_params(optimizer)], fp32_grads([0, 1]))


def test_delay_unscale_under_fp16_o2_matches_the_undelayed_accumulation():
    model, optimizer = initialized("O2")
    backward(model, optimizer, 0, delay_unscale=True)
    backward(model, optimizer, 1)
    delayed = [p.grad.clone() for p in amp.master_params(optimizer)]
    # fp16 accumulates scaled grads before unscaling: one extra fp16 rounding of the sum.
    torch.testing.assert_close(delayed, fp32_grads([0, 1]), **TOLERANCES[torch.float16])


def test_o2_with_loss_scale_one_accumulates_batchnorm_grads_over_two_backward_passes():
    # Apex quirk Q6: the fp32 BN params' first grads were dropped when the static scale was 1.
    model, optimizer = initialized("O2", loss_scale=1)
    x = batch(0)
    output = model(x)
    with amp.scale_loss(loss_of(output), optimizer) as scaled_loss:
        scaled_loss.backward(retain_graph=True)
    once = [p.grad.clone() for p in amp.master_params(optimizer)]
    with amp.scale_loss(loss_of(output), optimizer) as scaled_loss:
        scaled_loss.backward()
    assert_identical([p.grad for p in amp.master_params(optimizer)], [2 * g for g in once])
    assert model.bn.weight.grad is not None and torch.equal(model.bn.weight.grad, 2 * once[2])


def test_delay_overflow_check_unscales_but_neither_checks_nor_skips():
    model, optimizer = initialized("O1")
    scaler = _amp_state.loss_scalers[0]
    with amp.scale_loss(loss_of(model(batch(0))), optimizer, delay_overflow_check=True) as scaled_loss:
        scaled_loss.backward()
        poison_grad(model.fc2.bias)
    assert scaler.loss_scale() == 2.0**16 and scaler._unskipped == 0
    assert not torch.isfinite(model.fc2.bias.grad).all()
    torch.testing.assert_close(model.fc1.weight.grad, fp32_grads([0])[0], **TOLERANCES[torch.float16])
    optimizer.step()
    assert bool(amp.last_step_applied(optimizer))


def test_loss_id_selects_its_own_scaler():
    model, optimizer = initialized("O1", num_losses=2)
    with amp.scale_loss(loss_of(model(batch(0))), optimizer, loss_id=1) as scaled_loss:
        scaled_loss.backward()
        poison_grad(model.fc2.bias)
    assert [s.loss_scale() for s in _amp_state.loss_scalers] == [2.0**16, 2.0**15]


@pytest.mark.parametrize("loss_id", [2, -1, True])
def test_loss_id_out_of_range_is_an_index_error(loss_id):
    model, optimizer = initialized("O1", num_losses=2)
    with pytest.raises(IndexError, match="num_losses=2"):
        with amp.scale_loss(loss_of(model(batch(0))), optimizer, loss_id=loss_id):
            pass


@pytest.mark.parametrize("container", [list, tuple])
def test_list_or_tuple_of_optimizers_accumulates_like_one_optimizer(container):
    model = net()
    optimizers = container([sgd(model.fc1.parameters()),
                            sgd(list(model.bn.parameters()) + list(model.fc2.parameters()))])
    model, optimizers = amp.initialize(model, optimizers, opt_level="O0", loss_scale="dynamic", verbosity=0)
    for step in (0, 1):
        with amp.scale_loss(loss_of(model(batch(step))), optimizers) as scaled_loss:
            scaled_loss.backward()
    assert_identical([p.grad for p in model.parameters()], fp32_grads([0, 1]))


@pytest.mark.parametrize("opt_level, overrides", [
    ("O0", {}), ("O3", {}), ("O4", {}), ("O1", dict(loss_scale=1))])
def test_static_scale_one_without_masters_yields_the_float_loss_and_touches_nothing(opt_level, overrides):
    model, optimizer = initialized(opt_level, **overrides)
    loss = loss_of(model(batch(0)))
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    scaler = _amp_state.loss_scalers[0]
    with amp.scale_loss(loss.half(), None) as scaled_loss:
        assert scaled_loss.dtype == torch.float32 and scaled_loss.item() == loss.half().float().item()
    assert_identical([p.grad for p in model.parameters()], grads)
    assert scaler._unskipped == 0 and optimizer._amp_stash.found_inf_by_loss == {}


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2"])
def test_a_body_that_raises_leaves_the_grads_the_optimizer_sees_as_before(opt_level):
    model, optimizer = initialized(opt_level, loss_scale="dynamic")
    backward(model, optimizer, 0)
    before = [p.grad.clone() for p in amp.master_params(optimizer)]
    fp32_model_grads = {p: p.grad.clone() for p in model.parameters() if p.dtype == torch.float32}
    with pytest.raises(ValueError, match="user error"):
        with amp.scale_loss(loss_of(model(batch(1))), optimizer) as scaled_loss:
            scaled_loss.backward()
            raise ValueError("user error")
    assert_identical([p.grad for p in amp.master_params(optimizer)], before)
    for param, grad in fp32_model_grads.items():
        assert torch.equal(param.grad, grad)
    # The next block still accumulates onto the untouched grads.
    backward(model, optimizer, 1)
    if opt_level == "O0":
        assert_identical([p.grad for p in model.parameters()], fp32_grads([0, 1]))


def test_scale_loss_before_initialize_is_an_error():
    with pytest.raises(RuntimeError, match="amp.initialize"):
        with amp.scale_loss(torch.ones(()), None):
            pass


def test_optimizer_not_returned_by_initialize_is_an_error():
    model, _ = initialized("O2")
    with pytest.raises(RuntimeError, match="not returned by amp.initialize"):
        with amp.scale_loss(loss_of(model(batch(0))), sgd(net().parameters())):
            pass
