"""Training through amp with tensors of one parameter in different memory formats.

The multi-tensor ops refuse tensors of one index stored in different orders (they pair elements in
memory order); amp must still train correctly when it hands them such tensors itself: a ``.grad``
assigned by the user in another format than its param's, a model made channels_last after
``amp.initialize``, optimizer state loaded from a checkpoint of a contiguous model. Each run is
compared with the same run on a contiguous model: the loss is elementwise in the parameter, so its
gradients, and every step, are the same bits in any memory format.
"""
import copy

import pytest
import torch

import amp
from amp import _memory_formats
from amp.multi_tensor_apply import amp_C, use_extension

pytestmark = pytest.mark.filterwarnings("ignore:amp.*different memory formats:UserWarning")
PATHS = ("fallback", pytest.param("amp_C", marks=pytest.mark.skipif(amp_C is None, reason="amp_C is not built")))
CHANNELS_LAST = torch.channels_last


class Elementwise(torch.nn.Module):
    """A 4-d parameter and a loss elementwise in it: its gradient is ``x`` times the loss scale."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(4, 3, 2, 5, generator=gen))
        self.register_buffer("x", torch.randn(4, 3, 2, 5, generator=gen))

    def forward(self):
        return (self.weight * self.x.to(self.weight.dtype)).float().sum()


def stored_as(t, memory_format):
    return t.is_contiguous(memory_format=memory_format)


def train(opt_level, optimizer, steps=3, channels_last=False, after_initialize=False, assign_grads=False,
          model=None, state=None):
    """The master (or only) weight after ``steps`` steps; the model and optimizer are returned too."""
    model = model or Elementwise()
    if channels_last and not after_initialize:
        model = model.to(memory_format=CHANNELS_LAST)
    opt = optimizer(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=opt_level, loss_scale=128.0, verbosity=0)
    if after_initialize:
        model = model.to(memory_format=CHANNELS_LAST)
    if state is not None:
        opt.load_state_dict(state)
    for _ in range(steps):
        opt.zero_grad()
        with amp.scale_loss(model(), opt) as scaled:
            scaled.backward()
            if assign_grads:
                model.weight.grad = model.weight.grad.contiguous()
        opt.step()
    return next(p for group in opt.param_groups for p in group["params"]), model, opt


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def fused_adam(params):
    return amp.optimizers.FusedAdam(params, lr=0.1, weight_decay=0.01)


def fused_sgd(params):
    return amp.optimizers.FusedSGD(params, lr=0.1, momentum=0.9)


def assert_same_values(ours, reference):
    assert torch.equal(ours.detach().contiguous(), reference.detach().contiguous())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("opt_level", ["O2", "O5"])
def test_masters_of_a_channels_last_model_are_channels_last_and_need_no_copies(monkeypatch, path, opt_level):
    def refuse(*args):
        raise AssertionError("amp handed an op tensors in different memory formats")
    monkeypatch.setattr(_memory_formats, "restaged", refuse)
    with use_extension(path == "amp_C"):
        for optimizer in (sgd, fused_adam, fused_sgd):
            master, model, _ = train(opt_level, optimizer, channels_last=True)
            assert stored_as(master, CHANNELS_LAST) and not master.is_contiguous()
            assert stored_as(model.weight, CHANNELS_LAST)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("opt_level, optimizer", [("O2", sgd), ("O2", fused_adam), ("O2", fused_sgd),
                                                  ("O0", fused_adam), ("O0", fused_sgd)])
def test_a_grad_assigned_in_another_memory_format_trains_as_a_contiguous_model(path, opt_level, optimizer):
    with use_extension(path == "amp_C"):
        reference, _, _ = train(opt_level, optimizer)
        master, model, _ = train(opt_level, optimizer, channels_last=True, assign_grads=True)
    assert stored_as(model.weight, CHANNELS_LAST)
    assert_same_values(master, reference)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("optimizer", [sgd, fused_adam, fused_sgd])
def test_a_model_made_channels_last_after_initialize_trains_as_a_contiguous_model(path, optimizer):
    with use_extension(path == "amp_C"):
        reference_master, reference_model, _ = train("O2", optimizer)
        master, model, _ = train("O2", optimizer, channels_last=True, after_initialize=True)
    assert stored_as(model.weight, CHANNELS_LAST) and not model.weight.is_contiguous()
    assert_same_values(master, reference_master)
    assert_same_values(model.weight, reference_model.weight)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("optimizer", [fused_adam, fused_sgd])
def test_state_from_a_contiguous_model_resumes_on_a_channels_last_one(path, optimizer):
    with use_extension(path == "amp_C"):
        reference, _, _ = train("O0", optimizer, steps=4)
        _, model, opt = train("O0", optimizer, steps=2)
        state = copy.deepcopy(opt.state_dict())
        resumed = Elementwise()
        with torch.no_grad():
            resumed.weight.copy_(model.weight)
        master, _, opt = train("O0", optimizer, steps=2, model=resumed.to(memory_format=CHANNELS_LAST),
                               state=state)
    assert stored_as(master, CHANNELS_LAST) and not master.is_contiguous()
    assert_same_values(master, reference)


def test_amp_warns_that_it_copies_tensors_stored_in_another_memory_format():
    with pytest.warns(UserWarning, match="multi_tensor_scale got tensors of one index in different memory formats"):
        train("O2", sgd, steps=1, channels_last=True, assign_grads=True)
