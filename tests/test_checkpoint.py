"""amp.state_dict / load_state_dict, and Apex's checkpoint recipe resuming bit-identically."""
import io

import pytest
import torch
from torch import nn

import amp
from amp._amp_state import _amp_state
from amp_common import (LEVELS, MASTER_LEVELS, adam, assert_identical, batch, initialized, loss_of,
                        net, sgd, snapshot, train_step)

STEPS = 6
SAVE_AFTER = 3
# Dynamic levels can skip; the checkpoint is then taken right after the skipped step.
INJECT = {"O1": {2}, "O2": {2}}


def final_state(model, optimizer):
    return dict(snapshot(model, optimizer), amp=amp.state_dict())


def train(model, optimizer, steps, inject):
    for step in steps:
        train_step(model, optimizer, step, inject=step in inject)


def save(model, optimizer):
    buffer = io.BytesIO()
    torch.save(dict(model=model.state_dict(), optimizer=optimizer.state_dict(), amp=amp.state_dict()), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("opt_level", LEVELS)
@pytest.mark.parametrize("make_optimizer", [sgd, adam], ids=["sgd_momentum", "adam"])
def test_resumed_run_is_bit_identical_to_an_uninterrupted_run(opt_level, make_optimizer):
    inject = INJECT.get(opt_level, set())
    model, optimizer = initialized(opt_level, make_optimizer, growth_interval=2)
    train(model, optimizer, range(STEPS), inject)
    expected = final_state(model, optimizer)

    model, optimizer = initialized(opt_level, make_optimizer, growth_interval=2)
    train(model, optimizer, range(SAVE_AFTER), inject)
    checkpoint = save(model, optimizer)

    model, optimizer = initialized(opt_level, make_optimizer, seed=1, growth_interval=2)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    train(model, optimizer, range(SAVE_AFTER, STEPS), inject)
    assert_identical(final_state(model, optimizer), expected)


def test_resuming_right_after_a_skipped_step_restores_the_reduced_scale():
    model, optimizer = initialized("O2")
    train(model, optimizer, range(2), {1})
    checkpoint = save(model, optimizer)
    assert checkpoint["amp"]["loss_scaler0"]["loss_scale"] == 2.0**15
    model, optimizer = initialized("O2", seed=1)  # the saved run's objects are dropped, as on resume
    amp.load_state_dict(checkpoint["amp"])
    assert amp.loss_scale(optimizer=optimizer) == 2.0**15


def test_amp_state_dict_holds_every_scaler_as_plain_numbers():
    run = initialized("O2", num_losses=2)  # noqa: F841  (its objects in use keep it in use)
    state = amp.state_dict()
    assert list(state) == ["loss_scaler0", "loss_scaler1"]
    assert state["loss_scaler0"] == dict(loss_scale=2.0**16, unskipped=0, hysteresis_tracker=1, dynamic=True)


def test_amp_load_state_dict_restores_scale_and_counters():
    model, optimizer = initialized("O1", hysteresis=3)
    train(model, optimizer, range(3), {0})
    saved = amp.state_dict()
    model, optimizer = initialized("O1", hysteresis=3, seed=1)
    amp.load_state_dict(saved)
    assert amp.state_dict() == saved and saved["loss_scaler0"]["unskipped"] == 2


@pytest.mark.parametrize("bad_entry", [dict(loss_scale=-1.0, unskipped=0), dict(loss_scale="big", unskipped=0),
                                       dict(unskipped=0), dict(loss_scale=4.0, unskipped=0, extra=1)])
def test_a_bad_second_entry_leaves_the_first_scaler_unchanged(bad_entry):
    run = initialized("O2", num_losses=2)  # noqa: F841  (its objects in use keep it in use)
    with pytest.raises((ValueError, TypeError)):
        amp.load_state_dict(dict(loss_scaler0=dict(loss_scale=8.0, unskipped=5), loss_scaler1=bad_entry))
    assert [s.loss_scale() for s in _amp_state.loss_scalers] == [2.0**16, 2.0**16]
    assert [s._unskipped for s in _amp_state.loss_scalers] == [0, 0]


@pytest.mark.parametrize("saved_losses, num_losses", [(1, 2), (3, 2)])
def test_loading_a_checkpoint_with_another_num_losses_is_an_error(saved_losses, num_losses):
    saved_run = initialized("O2", num_losses=saved_losses)
    saved = amp.state_dict()
    del saved_run  # gone, as after a restart
    _, optimizer = initialized("O2", num_losses=num_losses, seed=1)
    with pytest.raises(RuntimeError, match="num_losses"):
        amp.load_state_dict(saved)
    assert [amp.loss_scale(i, optimizer=optimizer) for i in range(num_losses)] == [2.0**16] * num_losses


def test_every_state_dict_loads_with_weights_only():
    model, optimizer = initialized("O2")
    train(model, optimizer, range(2), set())
    checkpoint = save(model, optimizer)
    assert set(checkpoint) == {"model", "optimizer", "amp"}


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_loss_scale_decreases_once_per_overflow_of_its_own_loss(opt_level):
    model, optimizer = initialized(opt_level, num_losses=3)
    for loss_id in range(3):
        for _ in range(loss_id):
            with amp.scale_loss(loss_of(model(batch(0)) * 2.0**17), optimizer, loss_id=loss_id) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    state = amp.state_dict()
    for loss_id in range(3):
        assert state[f"loss_scaler{loss_id}"]["loss_scale"] == 2.0**16 / 2**loss_id
        assert state[f"loss_scaler{loss_id}"]["unskipped"] == 0
    assert int(amp.skipped_steps(optimizer)) == 3


class TiedNet(nn.Module):
    """A language-model shape: the output head shares its weight with the embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.relu(self.fc(self.emb(tokens))))


def tied_initialized(opt_level, seed=0):
    torch.manual_seed(seed)
    model = TiedNet()
    return amp.initialize(model, sgd(model.parameters()), opt_level=opt_level, verbosity=0)


def train_tied(model, optimizer, steps):
    for step in steps:
        tokens = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(step))
        with amp.scale_loss(nn.functional.cross_entropy(model(tokens), tokens), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("opt_level", MASTER_LEVELS)
def test_tied_weight_saves_its_master_under_every_name(opt_level):
    model, optimizer = tied_initialized(opt_level)
    train_tied(model, optimizer, range(2))
    state = model.state_dict()
    assert torch.equal(state["head.weight"], state["emb.weight"])
    assert torch.equal(state["emb.weight"], next(amp.master_params(optimizer)))


@pytest.mark.parametrize("opt_level", MASTER_LEVELS)
def test_tied_weight_checkpoint_loads_the_exact_master_into_a_plain_fp32_model(opt_level):
    """A plain model loads the aliases in turn, so the last one wins: it must hold the master too."""
    model, optimizer = tied_initialized(opt_level)
    train_tied(model, optimizer, range(2))
    plain = TiedNet()
    plain.load_state_dict(save(model, optimizer)["model"])
    assert torch.equal(plain.emb.weight, next(amp.master_params(optimizer)))


def fc1_then_fc2_group(opt_level, seed=0):
    """fc1 (and BN) in the optimizer at initialize; fc2 added afterwards with add_param_group."""
    model = net(seed)
    optimizer = sgd(list(model.fc1.parameters()) + list(model.bn.parameters()))
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    optimizer.add_param_group({"params": list(model.fc2.parameters())})
    return model, optimizer


@pytest.mark.parametrize("opt_level", MASTER_LEVELS)
def test_masters_of_a_param_group_added_after_initialize_are_saved_and_restored(opt_level):
    model, optimizer = fc1_then_fc2_group(opt_level)
    train(model, optimizer, range(STEPS), set())
    expected = snapshot(model, optimizer)

    model, optimizer = fc1_then_fc2_group(opt_level)
    train(model, optimizer, range(SAVE_AFTER), set())
    checkpoint = save(model, optimizer)
    assert torch.equal(checkpoint["model"]["fc2.weight"], list(amp.master_params(optimizer))[-2])
    model, optimizer = fc1_then_fc2_group(opt_level, seed=1)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    train(model, optimizer, range(SAVE_AFTER, STEPS), set())
    assert_identical(snapshot(model, optimizer), expected)


def test_an_o2_checkpoint_resumes_at_o5_without_amp_state_as_the_refusal_says():
    model, optimizer = initialized("O2", adam)
    train(model, optimizer, range(SAVE_AFTER), {1})
    checkpoint = save(model, optimizer)
    masters = [p.detach().clone() for p in amp.master_params(optimizer)]
    state = [t.clone() for s in optimizer.state.values() for t in s.values()]

    model, optimizer = initialized("O5", adam, seed=1)  # bf16 after fp16 overflows
    with pytest.raises(RuntimeError, match="changed the opt level on purpose .* skip amp.load_state_dict"):
        amp.load_state_dict(checkpoint["amp"])
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    assert_identical([p.detach() for p in amp.master_params(optimizer)], masters)
    assert_identical([t for s in optimizer.state.values() for t in s.values()], state)
    train(model, optimizer, range(SAVE_AFTER, STEPS), set())


@pytest.mark.parametrize("opt_level", ["O2", "O5"])
def test_optimizer_state_loaded_before_initialize_resumes_bit_exactly(opt_level):
    # mmengine's order: the fp32 model and the optimizer load the checkpoint, then amp.initialize
    # runs (in the first optim_context). Its momentum must reach the fp32 masters unrounded.
    inject = INJECT.get(opt_level, set())
    model, optimizer = initialized(opt_level)
    train(model, optimizer, range(6), inject)
    expected = [p.detach().clone() for p in amp.master_params(optimizer)]
    model, optimizer = initialized(opt_level)
    train(model, optimizer, range(3), inject)
    checkpoint = save(model, optimizer)
    del model, optimizer
    model = net(seed=1)
    model.load_state_dict(checkpoint["model"])
    optimizer = sgd(model.parameters())
    optimizer.load_state_dict(checkpoint["optimizer"])
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    amp.load_state_dict(checkpoint["amp"])
    train(model, optimizer, range(3, 6), inject)
    assert_identical([p.detach() for p in amp.master_params(optimizer)], expected)
