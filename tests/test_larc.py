"""LARC through amp: accepted by initialize and scale_loss, stepped like plain fp32 LARC at every
opt level; and optimizers whose ``step`` takes no closure."""
import copy

import pytest
import torch
from torch import nn

import amp
from amp.parallel import LARC
from amp_common import assert_identical, batch, loss_of

OPT_LEVELS = ("O0", "O1", "O2", "O3", "O4", "O5")
LR, WEIGHT_DECAY, TRUST, EPS = 0.1, 1e-3, 0.02, 1e-8
STEPS = 3
# fp16/bf16 forward and backward against an fp32 reference; O0 is fp32 itself.
TOLERANCE = {"O0": 1e-6, "O1": 2e-3, "O2": 2e-3, "O3": 2e-2, "O4": 2e-2, "O5": 2e-2}


def linear(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


def reference_larc(steps, clip):
    """Plain fp32 LARC over plain SGD, written out: the local rate is
    trust * |p| / (|g| + wd * |p| + eps), divided by lr and capped at 1 when clipping."""
    model = linear()
    params = list(model.parameters())
    for step in range(steps):
        for p in params:
            p.grad = None
        loss_of(model(batch(step))).backward()
        with torch.no_grad():
            for p in params:
                p_norm, g_norm = p.norm(), p.grad.norm()
                local = TRUST * p_norm / (g_norm + WEIGHT_DECAY * p_norm + EPS)
                if clip:
                    local = torch.clamp(local / LR, max=1.0)
                p -= LR * (p.grad + WEIGHT_DECAY * p) * local
    return [p.detach() for p in params]


def larc_run(opt_level, steps, clip=True, **init_kwargs):
    model = linear()
    optimizer = LARC(torch.optim.SGD(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY),
                     trust_coefficient=TRUST, clip=clip, eps=EPS)
    init_kwargs.setdefault("loss_scale", 128.0)  # static: no overflow-skipped step to tell apart
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0, **init_kwargs)
    for step in range(steps):
        optimizer.zero_grad()
        with amp.scale_loss(loss_of(model(batch(step))), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_larc_through_amp_tracks_plain_fp32_larc(opt_level, clip):
    _, optimizer = larc_run(opt_level, STEPS, clip=clip)
    expected = reference_larc(STEPS, clip)
    for master, ref in zip(amp.master_params(optimizer), expected):
        torch.testing.assert_close(master.float(), ref, rtol=TOLERANCE[opt_level], atol=TOLERANCE[opt_level])


def test_larc_at_o0_equals_plain_fp32_larc_closely():
    _, optimizer = larc_run("O0", STEPS)
    for master, ref in zip(amp.master_params(optimizer), reference_larc(STEPS, clip=True)):
        torch.testing.assert_close(master, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("opt_level", ["O2", "O5"])
def test_larc_under_master_weights_steps_fp32_masters_held_by_the_inner_optimizer(opt_level):
    model, optimizer = larc_run(opt_level, 1)
    inner = [p for group in optimizer.optim.param_groups for p in group["params"]]
    assert [p.dtype for p in inner] == [torch.float32] * 2
    assert all(a is b for a, b in zip(inner, amp.master_params(optimizer)))
    assert all(p.dtype != torch.float32 for p in model.parameters())


def test_larc_skips_the_whole_step_on_overflow():
    model, optimizer = larc_run("O2", 1, loss_scale="dynamic")
    before = [p.detach().clone() for p in amp.master_params(optimizer)]
    with amp.scale_loss(loss_of(model(batch(5))), optimizer) as scaled_loss:
        scaled_loss.backward()
        with torch.no_grad():
            next(model.parameters()).grad.view(-1)[0] = float("inf")
    optimizer.step()
    assert not bool(amp.last_step_applied(optimizer))
    assert all(torch.equal(a, b) for a, b in zip(amp.master_params(optimizer), before))


def test_larc_checkpoint_round_trip_resumes_bit_exactly_under_o2():
    model, optimizer = larc_run("O2", 2, loss_scale="dynamic")
    # Both runs stay live in this process, so each saves and loads its own run's scalers.
    saved = copy.deepcopy(dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
                               amp=amp.state_dict(optimizer=optimizer)))
    for step in range(2, 4):
        with amp.scale_loss(loss_of(model(batch(step))), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    resumed = linear(seed=7)
    resumed_opt = LARC(torch.optim.SGD(resumed.parameters(), lr=LR, weight_decay=WEIGHT_DECAY),
                       trust_coefficient=TRUST, eps=EPS)
    resumed, resumed_opt = amp.initialize(resumed, resumed_opt, opt_level="O2", verbosity=0,
                                          loss_scale="dynamic")
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    amp.load_state_dict(saved["amp"], optimizer=resumed_opt)
    for step in range(2, 4):
        with amp.scale_loss(loss_of(resumed(batch(step))), resumed_opt) as scaled_loss:
            scaled_loss.backward()
        resumed_opt.step()
        resumed_opt.zero_grad()
    assert_identical(list(amp.master_params(resumed_opt)), list(amp.master_params(optimizer)))
    assert_identical(resumed.state_dict(), model.state_dict())


class ForeignLarc:
    """The shape of NVIDIA Apex's own apex.parallel.LARC: a plain object around ``optim``."""

    def __init__(self, optimizer):
        self.optim = optimizer

    param_groups = property(lambda self: self.optim.param_groups)
    state = property(lambda self: self.optim.state)

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none=True):
        self.optim.zero_grad(set_to_none)

    def add_param_group(self, group):
        self.optim.add_param_group(group)

    def step(self):
        self.optim.step()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_foreign_larc_style_wrapper_is_accepted_and_stepped(opt_level):
    model = linear()
    plain = linear()
    optimizer = ForeignLarc(torch.optim.SGD(model.parameters(), lr=LR))
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0, loss_scale=128.0)
    with amp.scale_loss(loss_of(model(batch(0))), [optimizer]) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    loss_of(plain(batch(0))).backward()
    torch.optim.SGD(plain.parameters(), lr=LR).step()
    for master, ref in zip(amp.master_params(optimizer), plain.parameters()):
        torch.testing.assert_close(master.float(), ref.detach(), rtol=2e-3, atol=2e-3)


def test_a_larc_and_its_own_inner_optimizer_together_are_refused():
    model = linear()
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(RuntimeError, match="more than once"):
        amp.initialize(model, [LARC(inner), inner], opt_level="O1", verbosity=0)
    assert not hasattr(inner, "_amp_stash")


def test_a_larc_around_an_already_initialized_optimizer_is_refused():
    model, inner = amp.initialize(linear(), torch.optim.SGD(linear().parameters(), lr=LR),
                                  opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match="only be passed through amp.initialize once"):
        amp.initialize(linear(), LARC(inner), opt_level="O1", verbosity=0)


class NoClosureSGD(torch.optim.SGD):
    """Like many custom optimizers (and LARC): ``step`` takes no closure at all."""

    def step(self):
        return super().step()


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_an_optimizer_whose_step_takes_no_closure_works_at_every_opt_level(opt_level):
    model = linear()
    plain = linear()
    model, optimizer = amp.initialize(model, NoClosureSGD(model.parameters(), lr=LR), opt_level=opt_level,
                                      verbosity=0, loss_scale=128.0)
    with amp.scale_loss(loss_of(model(batch(0))), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    loss_of(plain(batch(0))).backward()
    torch.optim.SGD(plain.parameters(), lr=LR).step()
    for master, ref in zip(amp.master_params(optimizer), plain.parameters()):
        torch.testing.assert_close(master.float(), ref.detach(), rtol=TOLERANCE[opt_level],
                                   atol=TOLERANCE[opt_level])


def test_larc_refuses_bad_arguments():
    sgd = torch.optim.SGD(linear().parameters(), lr=LR)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        LARC(object())
    with pytest.raises(ValueError, match="trust_coefficient"):
        LARC(sgd, trust_coefficient=-1)
    with pytest.raises(TypeError, match="clip"):
        LARC(sgd, clip="yes")


def test_larc_forwards_the_optimizer_interface():
    model = linear()
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    larc = LARC(sgd)
    assert larc.param_groups is sgd.param_groups and larc.state is sgd.state
    loss_of(model(batch(0))).backward()
    larc.step()
    assert larc.state_dict() == sgd.state_dict()
    larc.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    extra = nn.Parameter(torch.ones(2))
    larc.add_param_group({"params": [extra]})
    assert sgd.param_groups[-1]["params"] == [extra]
    assert not isinstance(larc, torch.optim.Optimizer)
