"""scale_loss/step misuse that would unscale twice or step scaled gradients raises, changing nothing."""
import warnings

import pytest
import torch

import amp
from amp_common import (LEVELS, MASTER_LEVELS, assert_identical, batch, initialized, loss_of, net, sgd, snapshot,
                        train_step)


def _grads(optimizer):
    return [None if p.grad is None else p.grad.clone() for p in amp.master_params(optimizer)]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_nested_scale_loss_on_the_same_optimizer_raises_and_the_outer_block_restores(opt_level):
    model, optimizer = initialized(opt_level)
    train_step(model, optimizer, 0)
    loss_of(model(batch(1)))
    with amp.scale_loss(loss_of(model(batch(1))), optimizer) as scaled_loss:
        scaled_loss.backward()
    before = _grads(optimizer)
    with pytest.raises(RuntimeError, match="entered again"):
        with amp.scale_loss(loss_of(model(batch(2))), optimizer) as outer:
            outer.backward()
            with amp.scale_loss(loss_of(model(batch(3))), optimizer):
                pass
    assert_identical(_grads(optimizer), before)
    assert optimizer._amp_stash.in_scale_loss is False


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_nested_block_over_several_optimizers_changes_none_of_them(opt_level):
    model = net()
    body, head = sgd(model.fc1.parameters()), sgd(model.fc2.parameters())
    model, (body, head) = amp.initialize(model, [body, head], opt_level=opt_level, verbosity=0)
    loss_of(model(batch(0))).backward()  # grads on every param that the inner block must keep
    model_grads = [p.grad.clone() for p in model.parameters()]
    with amp.scale_loss(loss_of(model(batch(1))), head):
        with pytest.raises(RuntimeError, match="entered again"):
            with amp.scale_loss(loss_of(model(batch(2))), [body, head]):
                pass
        assert body._amp_stash.in_scale_loss is False and head._amp_stash.in_scale_loss is True
        assert_identical([p.grad for p in model.fc1.parameters()], model_grads[:2])


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O4"])
def test_the_same_optimizer_twice_in_one_call_raises(opt_level):
    model, optimizer = initialized(opt_level)
    with pytest.raises(ValueError, match="more than once in this scale_loss"):
        with amp.scale_loss(loss_of(model(batch(0))), [optimizer, optimizer]):
            pass


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_step_after_delay_unscale_without_an_unscaling_backward_raises(opt_level):
    model, optimizer = initialized(opt_level)
    with amp.scale_loss(loss_of(model(batch(0))), optimizer, delay_unscale=True) as scaled_loss:
        scaled_loss.backward()
    before = snapshot(model, optimizer)
    with pytest.raises(RuntimeError, match="still scaled"):
        optimizer.step()
    after = snapshot(model, optimizer)
    assert_identical(after, before)

    # Finishing the accumulation properly trains as the undelayed two-loss recipe does.
    with amp.scale_loss(loss_of(model(batch(1))), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    reference_model, reference_opt = initialized(opt_level)
    for step in (0, 1):
        with amp.scale_loss(loss_of(reference_model(batch(step))), reference_opt) as scaled_loss:
            scaled_loss.backward()
    reference_opt.step()
    # O2 accumulates the two scaled fp16 grads in fp16 before unscaling: one extra rounding.
    torch.testing.assert_close([p.detach() for p in amp.master_params(optimizer)],
                               [p.detach() for p in amp.master_params(reference_opt)],
                               rtol=1e-3, atol=1e-4)


def test_step_inside_the_scale_loss_block_raises():
    model, optimizer = initialized("O2")
    with pytest.raises(RuntimeError, match="inside its amp.scale_loss block"):
        with amp.scale_loss(loss_of(model(batch(0))), optimizer) as scaled_loss:
            scaled_loss.backward()
            optimizer.step()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_param_shared_by_two_optimizers_in_one_call_raises(opt_level):
    model = net()
    everything = sgd(model.parameters())
    head = sgd(model.fc2.parameters())
    model, (everything, head) = amp.initialize(model, [everything, head], opt_level=opt_level,
                                               verbosity=0)
    loss = loss_of(model(batch(0)))
    with pytest.raises(ValueError, match="fc2.weight belongs to optimizers 0 and 1"):
        with amp.scale_loss(loss, [everything, head]):
            pass
    assert everything._amp_stash.in_scale_loss is False and head._amp_stash.in_scale_loss is False


def test_o2_step_without_scale_loss_warns_once():
    model, optimizer = initialized("O2")
    loss_of(model(batch(0))).backward()
    with pytest.warns(UserWarning, match="no amp.scale_loss backward since the last step"):
        optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()
        train_step(model, optimizer, 1)


@pytest.mark.parametrize("opt_level", LEVELS)
def test_an_amp_forward_inside_torch_autocast_warns_once_at_the_users_line(opt_level):
    model = amp.initialize(torch.nn.Linear(4, 2), opt_level=opt_level, verbosity=0)
    with pytest.warns(UserWarning, match="runs inside torch.autocast, which overrides") as caught:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(batch(0))
            model(batch(1))
    warned = [w for w in caught if "torch.autocast" in str(w.message)]
    assert len(warned) == 1 and warned[0].filename == __file__
    assert f"opt_level='{opt_level}'" in str(warned[0].message)


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O5"])
def test_an_amp_forward_without_autocast_or_inside_disable_casts_does_not_warn(opt_level):
    model, optimizer = initialized(opt_level)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_step(model, optimizer, 0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
            model(batch(1))
        with amp.disable_casts(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(batch(2))


def _clip_then_step(model, optimizer, step, clip):
    with amp.scale_loss(loss_of(model(batch(step))), optimizer) as scaled_loss:
        scaled_loss.backward()
    clip()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("make_optimizer", [
    sgd, lambda params: amp.optimizers.FusedAdam(params, lr=0.01),
    lambda params: amp.optimizers.FusedSGD(params, lr=0.1)], ids=["sgd", "FusedAdam", "FusedSGD"])
@pytest.mark.parametrize("opt_level", MASTER_LEVELS)
def test_clipping_the_models_grads_under_master_weights_warns_once_at_the_step(opt_level, make_optimizer):
    model, optimizer = initialized(opt_level, make_optimizer)
    with pytest.warns(UserWarning, match=r"clip_grad_norm_\(amp.master_params\(optimizer\)") as caught:
        for step in range(3):
            _clip_then_step(model, optimizer, step, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01))
    warned = [w for w in caught if "changed after amp.scale_loss exited" in str(w.message)]
    assert len(warned) == 1 and warned[0].filename == __file__


@pytest.mark.parametrize("opt_level", MASTER_LEVELS)
def test_assigning_a_models_grad_after_scale_loss_under_master_weights_warns(opt_level):
    model, optimizer = initialized(opt_level)

    def replace():
        model.fc1.weight.grad = torch.zeros_like(model.fc1.weight)

    with pytest.warns(UserWarning, match="changed after amp.scale_loss exited"):
        _clip_then_step(model, optimizer, 0, replace)


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O5"])
def test_clipping_the_masters_accumulating_and_zero_grad_between_blocks_do_not_warn(opt_level):
    model, optimizer = initialized(opt_level)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _clip_then_step(model, optimizer, 0,
                        lambda: torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 0.01))
        for step in (1, 2):  # two backward passes accumulate into one step
            with amp.scale_loss(loss_of(model(batch(step))), optimizer) as scaled_loss:
                scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with amp.scale_loss(loss_of(model(batch(3))), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.zero_grad()  # a step given up: its grads are gone, masters' included
        train_step(model, optimizer, 4)
    if opt_level == "O1":  # no masters: the model's own grads are stepped, and clipping them works
        _clip_then_step(model, optimizer, 5, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01))
