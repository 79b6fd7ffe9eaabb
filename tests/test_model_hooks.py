"""What amp attaches to an O2/O5 model: copies, pickling, wrappers and weights written from outside."""
import copy
import io

import pytest
import torch
from torch import nn

import amp
from amp_common import (MASTER_LEVELS, assert_identical, batch, initialized, loss_of, named_masters, net, sgd,
                        train_step)


@pytest.mark.parametrize("opt_level", MASTER_LEVELS)
def test_deep_copy_runs_its_own_weights_and_casts_its_inputs(opt_level):
    model, _ = initialized(opt_level)
    model.eval()
    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied.fc2.weight.zero_()
        copied.fc2.bias.fill_(1.0)
    output = copied(batch(0))
    assert output.dtype == torch.float32 and torch.equal(output, torch.ones(16, 2))
    assert not torch.equal(model(batch(0)), output)


@pytest.mark.parametrize("opt_level", MASTER_LEVELS)
def test_deep_copy_state_dict_is_its_own_weights_not_the_originals_masters(opt_level):
    model, optimizer = initialized(opt_level)
    for step in range(2):
        train_step(model, optimizer, step)
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for param in ema.parameters():
            param.mul_(0.5)
    state = ema.state_dict()
    assert all(torch.equal(state[name], param.float()) for name, param in ema.named_parameters())


def test_loading_into_a_deep_copy_leaves_the_originals_masters_alone():
    model, optimizer = initialized("O2")
    before = [master.clone() for master in amp.master_params(optimizer)]
    copied = copy.deepcopy(model)
    copied.load_state_dict({key: torch.zeros_like(value) for key, value in copied.state_dict().items()})
    assert all(torch.equal(a, b) for a, b in zip(amp.master_params(optimizer), before))


@pytest.mark.parametrize("opt_level", MASTER_LEVELS)
def test_whole_model_pickles_and_the_loaded_model_casts_like_the_original(opt_level):
    model, _ = initialized(opt_level)
    model.eval()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(batch(0)), model(batch(0)))
    assert loaded(batch(0)).dtype == torch.float32


class Parent(nn.Module):
    def __init__(self, child):
        super().__init__()
        self.child = child
        self.scale = nn.Linear(2, 2)

    def forward(self, x):
        return self.scale(self.child(x))


@pytest.mark.parametrize("opt_level", MASTER_LEVELS)
def test_state_dict_through_a_parent_module_saves_and_loads_the_fp32_masters(opt_level):
    model, optimizer = initialized(opt_level)
    for step in range(2):
        train_step(model, optimizer, step)
    state = Parent(model).state_dict()
    masters = named_masters(model, optimizer)
    assert all(torch.equal(state["child." + name], master) for name, master in masters.items())

    other, other_optimizer = initialized(opt_level, seed=1)
    Parent(other).load_state_dict(state)
    loaded = named_masters(other, other_optimizer)
    assert all(torch.equal(loaded[name], master) for name, master in masters.items())


def frozen_step(model, optimizer):
    """A full amp step with the learning rate at 0: the optimizer leaves every master where it is."""
    optimizer.param_groups[0]["lr"] = 0.0
    train_step(model, optimizer, 0)


@pytest.mark.parametrize("opt_level", MASTER_LEVELS)
def test_weights_loaded_into_a_submodule_after_initialize_are_not_reverted_by_the_step(opt_level):
    model, optimizer = initialized(opt_level)
    loaded = nn.Linear(8, 2)
    model.fc2.load_state_dict(loaded.state_dict())
    frozen_step(model, optimizer)
    dtype = model.fc2.weight.dtype
    assert torch.equal(model.fc2.weight, loaded.weight.detach().to(dtype))
    assert torch.equal(named_masters(model, optimizer)["fc2.weight"], loaded.weight.detach().to(dtype).float())


@pytest.mark.parametrize("opt_level", MASTER_LEVELS)
def test_weights_written_before_a_delay_unscale_accumulation_reach_the_masters(opt_level):
    # The first backward of the step leaves the grads scaled, so no backward is "prepared": the
    # written weights must still be taken into the masters before the step copies them back.
    model, optimizer = initialized(opt_level)
    optimizer.param_groups[0]["lr"] = 0.0
    loaded = nn.Linear(8, 2)
    model.fc2.load_state_dict(loaded.state_dict())
    for step, delay in ((0, True), (1, False)):
        with amp.scale_loss(loss_of(model(batch(step))), optimizer, delay_unscale=delay) as scaled:
            scaled.backward()
    optimizer.step()
    dtype = model.fc2.weight.dtype
    assert torch.equal(model.fc2.weight, loaded.weight.detach().to(dtype))


@pytest.mark.parametrize("opt_level", MASTER_LEVELS)
def test_weights_written_before_a_step_without_backward_are_not_reverted(opt_level):
    model, optimizer = initialized(opt_level)
    loaded = nn.Linear(8, 2)
    model.fc2.load_state_dict(loaded.state_dict())
    with pytest.warns(UserWarning, match="no amp.scale_loss backward"):
        optimizer.step()
    dtype = model.fc2.weight.dtype
    assert torch.equal(model.fc2.weight, loaded.weight.detach().to(dtype))


def test_masters_stay_exact_fp32_when_nothing_else_wrote_the_model():
    reference = net().state_dict()
    model, optimizer = initialized("O2")
    frozen_step(model, optimizer)
    assert torch.equal(named_masters(model, optimizer)["fc1.weight"], reference["fc1.weight"])


def hook_counts(model):
    """How many hooks of each kind ``model`` carries."""
    return [len(hooks) for hooks in (model._forward_pre_hooks, model._forward_hooks, model._state_dict_hooks,
                                     model._load_state_dict_pre_hooks)]


@pytest.mark.parametrize("levels", [["O1", "O2"], ["O1", "O1", "O1"], ["O1", "O1", "O5"]],
                         ids=lambda levels: "_then_".join(levels))
def test_a_model_initialized_again_carries_the_hooks_of_its_live_run_only(levels):
    # Each initialize of the same model (a notebook cell run again) used to add its hooks to those
    # of the earlier runs: O1 then O2 left 3 forward pre-hooks where a fresh O2 model has 2.
    model = net()
    for level in levels:
        amp.deactivate()
        model, optimizer = amp.initialize(model, sgd(model.parameters()), opt_level=level, verbosity=0)
    fresh, fresh_optimizer = initialized(levels[-1])
    assert hook_counts(model) == hook_counts(fresh)
    for step in range(2):
        train_step(model, optimizer, step)
        train_step(fresh, fresh_optimizer, step)
    assert_identical(model.state_dict(), fresh.state_dict())
