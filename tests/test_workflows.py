"""Workflows users copy from the PyTorch AMP examples, run through amp against fp32 references.

O0 with a dynamic scale is compared bit for bit (power-of-two scaling is exact in fp32); O2
rounds the model to fp16 and is compared with fp16 tolerances.
"""
import pytest
import torch

import amp
from amp._amp_state import _amp_state
from amp_common import TOLERANCES, assert_identical, batch, initialized, loss_of, net, sgd

CONFIGS = {"O0": dict(loss_scale="dynamic"), "O2": {}}


def check(actual, expected, opt_level):
    if opt_level == "O0":
        assert_identical(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, **TOLERANCES[torch.float16])


def fp32_params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("opt_level", list(CONFIGS))
def test_gradient_clipping_on_master_params_matches_fp32_clipping(opt_level):
    model, optimizer = initialized(opt_level, **CONFIGS[opt_level])
    reference = net()
    reference_optimizer = sgd(reference.parameters())
    for step in range(3):
        with amp.scale_loss(loss_of(model(batch(step))), optimizer) as scaled_loss:
            scaled_loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm=0.05)
        optimizer.step()
        optimizer.zero_grad()
        loss_of(reference(batch(step))).backward()
        expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.05)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        check(norm, expected_norm, opt_level)
    check(list(amp.master_params(optimizer)), fp32_params(reference), opt_level)


def penalised_loss(model, loss, inv_scale=1.0, scaled_loss=None):
    """The loss plus the squared norm of its gradients (a gradient penalty)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss if scaled_loss is None else scaled_loss, params, create_graph=True)
    penalty = sum((g.float() * inv_scale).pow(2).sum() for g in grads)
    return loss + penalty


@pytest.mark.parametrize("opt_level", list(CONFIGS))
def test_gradient_penalty_on_the_scaled_loss_unscaled_with_the_current_scale(opt_level):
    # The double backward multiplies the scale in twice: under fp16 a 2**16 scale overflows (and
    # amp rightly skips those steps), so the fp16 run caps the scale to compare every step.
    model, optimizer = initialized(opt_level, max_loss_scale=2.0**8, **CONFIGS[opt_level])
    reference = net()
    reference_optimizer = sgd(reference.parameters())
    for step in range(2):
        loss = loss_of(model(batch(step)))
        scale = _amp_state.loss_scalers[0].loss_scale()
        total = penalised_loss(model, loss, 1.0 / scale, loss * scale)
        with amp.scale_loss(total, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        assert bool(amp.last_step_applied(optimizer))
        optimizer.zero_grad()
        penalised_loss(reference, loss_of(reference(batch(step)))).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    check(list(amp.master_params(optimizer)), fp32_params(reference), opt_level)


@pytest.mark.parametrize("delay_unscale", [False, True])
@pytest.mark.parametrize("opt_level", list(CONFIGS))
def test_accumulation_over_micro_batches_matches_fp32_accumulation(opt_level, delay_unscale):
    model, optimizer = initialized(opt_level, **CONFIGS[opt_level])
    reference = net()
    reference_optimizer = sgd(reference.parameters())
    micro_batches = 4
    for step in range(2):
        for micro in range(micro_batches):
            x = batch(10 * step + micro, rows=4)
            last = micro == micro_batches - 1
            with amp.scale_loss(loss_of(model(x)) / micro_batches, optimizer,
                                delay_unscale=delay_unscale and not last) as scaled_loss:
                scaled_loss.backward()
            (loss_of(reference(x)) / micro_batches).backward()
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    check(list(amp.master_params(optimizer)), fp32_params(reference), opt_level)


def test_two_optimizers_where_only_one_skips():
    generator, critic = net(0), net(1)
    g_optimizer, c_optimizer = sgd(generator.parameters()), sgd(critic.parameters())
    [generator, critic], [g_optimizer, c_optimizer] = amp.initialize(
        [generator, critic], [g_optimizer, c_optimizer], opt_level="O2", num_losses=2, verbosity=0)
    g_before = [p.detach().clone() for p in amp.master_params(g_optimizer)]
    c_before = [p.detach().clone() for p in amp.master_params(c_optimizer)]
    with amp.scale_loss(loss_of(critic(batch(0))), c_optimizer, loss_id=0) as scaled_loss:
        scaled_loss.backward()
        critic.fc1.weight.grad.fill_(float("inf"))
    with amp.scale_loss(loss_of(generator(batch(1))), g_optimizer, loss_id=1) as scaled_loss:
        scaled_loss.backward()
    c_optimizer.step()
    g_optimizer.step()
    assert_identical(list(amp.master_params(c_optimizer)), c_before)
    assert not any(torch.equal(a, b) for a, b in zip(amp.master_params(g_optimizer), g_before))
    assert [bool(amp.last_step_applied(o)) for o in (c_optimizer, g_optimizer)] == [False, True]
    assert [s.loss_scale() for s in _amp_state.loss_scalers] == [2.0**15, 2.0**16]


def test_o1_training_follows_the_fp32_reference_within_fp16_tolerance():
    model, optimizer = initialized("O1")
    reference = net()
    reference_optimizer = sgd(reference.parameters())
    for step in range(3):
        with amp.scale_loss(loss_of(model(batch(step))), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_of(reference(batch(step))).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    torch.testing.assert_close(fp32_params(model), fp32_params(reference), **TOLERANCES[torch.float16])


def o2_reference_step(model16, masters, momentum, step, scale):
    """Apex O2 by hand: fp16 model (fp32 BN), fp32 masters, unscale by 1/scale, SGD on masters, copy back."""
    loss = loss_of(model16(batch(step).half()))
    (loss.float() * scale).backward()
    for param, master, buf in zip(model16.parameters(), masters, momentum):
        grad = param.grad.float() * (1.0 / scale)
        buf.mul_(0.9).add_(grad) if buf.numel() else buf.set_(grad.clone())
        master.data.add_(buf, alpha=-0.1)
        param.data.copy_(master.data)
        param.grad = None


def test_o2_training_equals_a_hand_written_fp16_loop_with_fp32_masters():
    model, optimizer = initialized("O2")
    model16 = net()
    masters = [p.detach().clone() for p in model16.parameters()]
    for module in (model16.fc1, model16.fc2):
        module.half()
    momentum = [torch.empty(0) for _ in masters]
    for step in range(4):
        with amp.scale_loss(loss_of(model(batch(step))), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        o2_reference_step(model16, masters, momentum, step, 2.0**16)
    assert_identical(list(amp.master_params(optimizer)), masters)
    assert_identical(fp32_params(model), fp32_params(model16))
