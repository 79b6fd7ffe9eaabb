"""amp.initialize is all-or-nothing: a rejected call changes nothing, and a retry works.

Each case first starts an O2 run (model A), then makes a call that must be rejected (on model B),
then trains run A and compares it bit for bit with the same run trained without that call.
"""
import pytest
import torch
from torch import nn

import amp
from amp._amp_state import _amp_state
from amp_common import assert_identical, initialized, net, sgd, train_step


class WithParam(nn.Module):
    """A Net plus one extra parameter of a given dtype."""

    def __init__(self, dtype):
        super().__init__()
        self.body = net()
        self.extra = nn.Parameter(torch.ones(3, dtype=dtype))

    def forward(self, x):
        return self.body(x)


def _model_b():
    return net(seed=1)


# (description, callable(model, optimizer) making the bad call, expected error, message fragment)
BAD_CALLS = [
    ("opt level typo", lambda m, o: amp.initialize(m, o, opt_level="02", verbosity=0),
     RuntimeError, "letter O"),
    ("verbosity 3", lambda m, o: amp.initialize(m, o, opt_level="O2", verbosity=3),
     ValueError, "verbosity"),
    ("verbosity True", lambda m, o: amp.initialize(m, o, opt_level="O2", verbosity=True),
     ValueError, "verbosity"),
    ("bad growth factor", lambda m, o: amp.initialize(m, o, opt_level="O2", verbosity=0,
                                                      growth_factor=0.5), ValueError, "> 1"),
    ("negative min scale", lambda m, o: amp.initialize(m, o, opt_level="O2", verbosity=0,
                                                       min_loss_scale=-1.0), ValueError, "min_loss_scale"),
    ("enabled as a string", lambda m, o: amp.initialize(m, o, opt_level="O2", enabled="False"),
     TypeError, "enabled must be True or False"),
    ("master_weights as a string", lambda m, o: amp.initialize(m, o, opt_level="O2", verbosity=0,
                                                               master_weights="False"),
     TypeError, "master_weights must be True, False, None or 'remainder'"),
    ("patch_torch_functions as a string",
     lambda m, o: amp.initialize(m, o, opt_level="O1", verbosity=0, patch_torch_functions="False"),
     TypeError, "patch_torch_functions must be True or False"),
    ("loss_scale True", lambda m, o: amp.initialize(m, o, opt_level="O2", verbosity=0, loss_scale=True),
     TypeError, "a bool is not a loss scale"),
    ("integer output type", lambda m, o: amp.initialize(m, o, opt_level="O2", verbosity=0,
                                                        cast_model_outputs=torch.int64),
     TypeError, "cast_model_outputs must be a floating-point"),
    ("float64 model type", lambda m, o: amp.initialize(m, o, opt_level="O2", verbosity=0,
                                                       cast_model_type=torch.float64),
     TypeError, "cast_model_type must be"),
    ("group given by name", lambda m, o: amp.initialize(m, o, opt_level="O2", verbosity=0,
                                                        overflow_process_group="world"),
     TypeError, "overflow_process_group must be None or a torch.distributed process group"),
    ("O1 with a cast model type", lambda m, o: amp.initialize(m, o, opt_level="O1", verbosity=0,
                                                              cast_model_type=torch.float16),
     RuntimeError, "cast_model_type should be None"),
    ("an optimizer twice", lambda m, o: amp.initialize(m, [o, o], opt_level="O2", verbosity=0),
     RuntimeError, "more than once"),
    ("a model twice", lambda m, o: amp.initialize([m, m], o, opt_level="O2", verbosity=0),
     RuntimeError, "same model appears more than once"),
]


def _reference_run_a(steps):
    model, optimizer = initialized("O2")
    for step in range(steps):
        train_step(model, optimizer, step, inject=(step == 1))
    return [p.detach().clone() for p in amp.master_params(optimizer)]


@pytest.mark.parametrize("case", BAD_CALLS, ids=[case[0] for case in BAD_CALLS])
def test_a_rejected_call_changes_nothing_and_an_earlier_run_keeps_training(case):
    _, bad_call, error, fragment = case
    expected = _reference_run_a(4)

    model_a, optimizer_a = initialized("O2")
    train_step(model_a, optimizer_a, 0)
    model_b = _model_b()
    optimizer_b = sgd(model_b.parameters())
    params_b = [p.detach().clone() for p in model_b.parameters()]
    groups_b = [list(group["params"]) for group in optimizer_b.param_groups]
    latest = _amp_state.opt_properties

    with pytest.raises(error, match=fragment):
        bad_call(model_b, optimizer_b)

    assert _amp_state.opt_properties is latest
    assert not hasattr(optimizer_b, "_amp_stash") and "step" not in vars(optimizer_b)
    assert [list(group["params"]) for group in optimizer_b.param_groups] == groups_b
    assert_identical([p.detach() for p in model_b.parameters()], params_b)
    assert "forward" not in vars(model_b)

    for step in range(1, 4):
        train_step(model_a, optimizer_a, step, inject=(step == 1))
    assert_identical([p.detach() for p in amp.master_params(optimizer_a)], expected)

    # The same objects can be initialized after the rejection.
    model_b, optimizer_b = amp.initialize(model_b, optimizer_b, opt_level="O2", verbosity=0)
    train_step(model_b, optimizer_b, 0)
    assert model_b.fc1.weight.dtype == torch.float16


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O5"])
def test_float64_and_complex_params_are_rejected_by_name(opt_level, dtype):
    model = WithParam(dtype)
    optimizer = sgd(model.parameters())
    with pytest.raises(TypeError, match=rf"Parameter extra has dtype {dtype}.*model.float\(\)"):
        amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    assert model.extra.dtype == dtype and model.body.fc1.weight.dtype == torch.float32
    assert not hasattr(optimizer, "_amp_stash")


@pytest.mark.parametrize("dtype", [torch.int64, torch.float8_e4m3fn])
def test_an_integer_or_fp8_param_in_the_optimizer_is_rejected_before_anything_changes(dtype):
    model = net()
    other = nn.Parameter(torch.zeros(2).to(dtype), requires_grad=False)
    optimizer = sgd([{"params": list(model.parameters())}, {"params": [other]}])
    with pytest.raises(TypeError, match="optimizer 0.*must be floating point"):
        amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    assert model.fc1.weight.dtype == torch.float32 and not hasattr(optimizer, "_amp_stash")


def test_a_rejected_call_leaves_the_o1_patches_of_an_earlier_run_in_place():
    initialized("O1")
    handle = _amp_state.handle
    with pytest.raises(RuntimeError):
        amp.initialize(_model_b(), opt_level="0O", verbosity=0)
    assert _amp_state.handle is handle
    assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float16
