"""amp.optimizers.FusedSGD / FusedAdam: alone, and under amp at every opt level, against torch's optimizers.

The references are torch.optim.SGD / Adam / AdamW (``foreach=False``; Adam's with the correctly
rounded square root that the kernels take) on the same data, through
the same amp path (fp32 master grads, separate master->model copy) or without amp. Where the fused
kernel performs the same fp32 operations in the same order the results are bit-identical; where it
cannot (pure fp16/bf16 params at O3, which torch updates with a rounding after every operation and
the kernel in fp32; grads accumulated in fp16 without master grads) the tests state the bound.
"""
import contextlib
import copy
import io

import pytest
import torch
from torch import nn

import amp
from amp._controller.unmade_grad import UnmadeGrad
from amp.multi_tensor_apply import MultiTensorApply, use_extension
from amp.optimizers import FusedAdam, FusedSGD
from amp_common import (LEVELS, LOW_DTYPE, MASTER_LEVELS, assert_identical, batch, loss_of, net,
                        poison_grad, snapshot, with_correctly_rounded_sqrt)
from test_multiple_models_losses import SCENARIOS, Product, inputs
from test_sync_free import count_host_reads

# name -> (fused class, torch reference class, the arguments both take)
PAIRS = {
    "sgd": (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "sgd_nesterov": (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.5, nesterov=True)),
    "adam": (FusedAdam, torch.optim.Adam, dict(lr=0.01, eps=1e-4, weight_decay=0.01)),
    "adamw": (FusedAdam, torch.optim.AdamW, dict(lr=0.01, eps=1e-4, weight_decay=0.01)),
}


def fused(name, **options):
    """A maker of the fused optimizer of ``PAIRS[name]`` (``options``: its own extra arguments)."""
    cls, _, kwargs = PAIRS[name]
    mode = {"adam_w_mode": name == "adamw"} if cls is FusedAdam else {}
    return lambda params: cls(params, **kwargs, **mode, **options)


def reference(name):
    # The kernels' Adam takes the correctly rounded fp32 square root; torch's CPU sqrt (MKL) is an
    # ulp off for about one root in six, which drifts Adam's params by a CPU-dependent few ulps
    # (up to 62 ulps of an element in these tests). With torch's sqrt rounded correctly, torch.optim
    # performs the kernels' fp32 operations in their order, so every comparison here is bit for bit.
    _, cls, kwargs = PAIRS[name]
    return lambda params: with_correctly_rounded_sqrt(cls)(params, **kwargs, foreach=False)


MODEL_GRADS = dict(materialize_master_grads=False)
# One extra fp16 rounding of the summed scaled grad (relative 2**-11) moves an update of ~lr * |g|
# by far less than this over a few steps; a wrongly scaled pass moves it by ~lr * |g| (~1e-2).
ACCUMULATION_ATOL = 1e-3
# O3 trains fp16 params without masters: torch rounds after every operation, the kernels once.
EXACT_LEVELS = [level for level in LEVELS if level != "O3"]
EXTENSION = [False] + ([True] if MultiTensorApply.available else [])
STEPS = 4


def run(opt_level, make_optimizer, steps=STEPS, inject=(), backward_passes=1, seed=0, **options):
    """Train ``Net`` through amp; returns (model, optimizer)."""
    model = net(seed)
    optimizer = make_optimizer(model.parameters())
    options.setdefault("verbosity", 0)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, **options)
    for step in steps if isinstance(steps, range) else range(steps):
        for micro in range(backward_passes):
            loss = loss_of(model(batch(step * backward_passes + micro)))
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
                if (step, micro) in inject:
                    poison_grad(next(model.parameters()))
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def trained(model, optimizer):
    """What training produced: the model's params and buffers, the masters, the optimizer's state."""
    state = optimizer.state_dict()["state"]
    kept = ("momentum_buffer", "exp_avg", "exp_avg_sq")  # torch's Adam also keeps a per-param "step"
    return dict(model=dict(model.state_dict()), masters=[p.detach() for p in amp.master_params(optimizer)],
                state=[{k: v for k, v in state[i].items() if k in kept} for i in sorted(state)])


def untouched(model, optimizer):
    """What a skipped step must leave as it was (the forward still updates batch-norm statistics)."""
    state = snapshot(model, optimizer)
    del state["model"]
    return state


def ulp_distance(actual, expected):
    """The largest distance in units in the last place between two float tensors of one dtype."""
    assert actual.dtype == expected.dtype
    bits, magnitude = (torch.int32, 0x7FFFFFFF) if actual.dtype == torch.float32 else (torch.int16, 0x7FFF)

    def ordered(t):
        i = t.contiguous().view(bits).to(torch.int64)
        return torch.where(i >= 0, i, -(i & magnitude))
    return int((ordered(actual) - ordered(expected)).abs().max()) if actual.numel() else 0


# -- constructors -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(amsgrad=True), "amsgrad"), (dict(capturable=True), "capturable"),
    (dict(master_weights=True), "opt_level='O2'"), (dict(lr=-1.0), "learning rate"),
    (dict(betas=(0.9, 1.0)), "beta parameter at index 1"), (dict(eps=-1e-8), "epsilon"),
    (dict(weight_decay=-0.1), "weight_decay")])
def test_fused_adam_refuses_what_it_does_not_offer_saying_what_to_do(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusedAdam([nn.Parameter(torch.zeros(2))], **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=-0.1), "learning rate"), (dict(lr=0.1, momentum=-0.5), "momentum"),
    (dict(lr=0.1, nesterov=True), "Nesterov"), (dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
                                                    "Nesterov")])
def test_fused_sgd_refuses_invalid_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusedSGD([nn.Parameter(torch.zeros(2))], **kwargs)


def test_fused_sgd_needs_a_learning_rate_as_apex_did():
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        FusedSGD([nn.Parameter(torch.zeros(2))])


@pytest.mark.parametrize("make", [lambda p: FusedSGD(p, lr=0.1), FusedAdam], ids=["sgd", "adam"])
def test_float64_params_are_refused_naming_the_dtype(make):
    with pytest.raises(TypeError, match="torch.float64"):
        make([nn.Parameter(torch.zeros(2, dtype=torch.float64))])


def test_apex_defaults():
    adam = FusedAdam([nn.Parameter(torch.zeros(2))])
    assert (adam.defaults["lr"], adam.defaults["betas"], adam.defaults["eps"]) == (1e-3, (0.9, 0.999), 1e-8)
    assert adam.adam_w_mode and adam.set_grad_none and adam.materialize_master_grads
    sgd = FusedSGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    assert sgd.materialize_master_grads and not sgd.set_grad_none and not sgd.wd_after_momentum


# -- without amp ------------------------------------------------------------------------------

def plain_run(make_optimizer, dtype=torch.float32, steps=STEPS, scheduler=False):
    model = net().to(dtype)
    optimizer = make_optimizer(model.parameters())
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5) if scheduler else None
    for step in range(steps):
        loss_of(model(batch(step).to(dtype))).backward()
        optimizer.step()
        optimizer.zero_grad()
        if schedule is not None:
            schedule.step()
    return model, optimizer


@pytest.mark.parametrize("extension", EXTENSION, ids=lambda e: "amp_C" if e else "torch")
@pytest.mark.parametrize("name", PAIRS)
def test_without_amp_fp32_matches_torch(name, extension):
    with use_extension(extension):
        expected = trained(*plain_run(reference(name), scheduler=True))
        actual = trained(*plain_run(fused(name), scheduler=True))
    assert_identical(actual, expected)


def test_a_param_group_of_several_dtypes_steps_each_dtype_as_its_own_optimizer_would():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3).to(dtype)) for dtype in (torch.float32, torch.float16, torch.bfloat16)]
    alone = [nn.Parameter(p.detach().clone()) for p in params]
    together = FusedAdam(params, lr=0.1)
    separate = [FusedAdam([p], lr=0.1) for p in alone]
    for step in range(3):
        for p, q in zip(params, alone):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)).to(p.dtype)
            q.grad = p.grad.clone()
        together.step()
        for optimizer in separate:
            optimizer.step()
    assert_identical([p.detach() for p in params], [p.detach() for p in alone])


@pytest.mark.parametrize("make", [lambda p: FusedSGD(p, lr=0.1), FusedAdam], ids=["sgd", "adam"])
def test_sparse_gradients_are_refused_before_anything_changes(make):
    embedding = nn.Embedding(10, 3, sparse=True)
    linear = nn.Linear(3, 1)
    optimizer = make(list(linear.parameters()) + list(embedding.parameters()))
    linear(embedding(torch.tensor([1, 2]))).sum().backward()
    before = [p.detach().clone() for p in optimizer.param_groups[0]["params"]]
    with pytest.raises(RuntimeError, match="sparse gradients"):
        optimizer.step()
    assert_identical([p.detach() for p in optimizer.param_groups[0]["params"]], before)
    assert not optimizer.state


def test_zero_grad_follows_set_grad_none():
    param = nn.Parameter(torch.zeros(2))
    param.grad = torch.ones(2)
    FusedSGD([param], lr=0.1).zero_grad()
    assert torch.equal(param.grad, torch.zeros(2))
    FusedAdam([param]).zero_grad()
    assert param.grad is None


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_state_dict_loads_with_weights_only_and_resumes_bit_exactly(name):
    expected = trained(*plain_run(fused(name), steps=5))
    model, optimizer = plain_run(fused(name), steps=3)
    buffer = io.BytesIO()
    torch.save(dict(model=model.state_dict(), optimizer=optimizer.state_dict()), buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    model = net(seed=1)
    optimizer = fused(name)(model.parameters())
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    for step in range(3, 5):
        loss_of(model(batch(step))).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert_identical(trained(model, optimizer), expected)


@pytest.mark.parametrize("step", [-1, -1.0, 2.5, float("nan"), 2**31 - 1, True, torch.tensor([-1.0]),
                                  torch.tensor([2.0**31]), torch.tensor([1.0, 2.0])], ids=repr)
def test_fused_adam_refuses_to_load_a_step_count_its_kernel_could_not_take(step):
    # Beyond 2**31 - 1 (or below 1) a step number on a GPU makes every step a silent no-op.
    model, optimizer = plain_run(fused("adamw"), steps=2)
    checkpoint = optimizer.state_dict()
    checkpoint["param_groups"][0]["step"] = step
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(ValueError, match="param group 0 has the step count"):
        optimizer.load_state_dict(checkpoint)
    after = optimizer.state_dict()
    assert after["param_groups"][0]["step"] == before["param_groups"][0]["step"] == 2
    assert all(torch.equal(after["state"][i][key], before["state"][i][key])
               for i in before["state"] for key in before["state"][i])


class PolyWarmUp:
    """The LR scheduler of NVIDIA's BERT pretraining (DeepLearningExamples): the learning rate from
    the step count Apex's optimizers keep in ``param_groups[0]["step"]``."""

    def __init__(self, optimizer, warmup=0.5, total_steps=8):
        self.optimizer, self.warmup, self.total_steps = optimizer, warmup, total_steps
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]

    def step(self):
        group = self.optimizer.param_groups[0]
        progress = (group["step"] + 1 if "step" in group else 1) / self.total_steps
        for group, base_lr in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base_lr * (progress / self.warmup if progress < self.warmup else
                                     (1.0 - progress) ** 0.5)


def test_fused_adam_keeps_apexs_python_int_step_count_that_an_lr_scheduler_can_read():
    model = net()
    optimizer = FusedAdam(model.parameters(), lr=0.01)
    reference_model = net()
    reference_optimizer = FusedAdam(reference_model.parameters(), lr=0.01)
    schedule = PolyWarmUp(optimizer)
    for step in range(4):
        schedule.step()
        loss_of(model(batch(step))).backward()
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.param_groups[0]["lr"] = 0.01 * min((step + 1) / 4, (1 - (step + 1) / 8) ** 0.5)
        loss_of(reference_model(batch(step))).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    assert type(optimizer.param_groups[0]["step"]) is int and optimizer.param_groups[0]["step"] == 4
    assert type(optimizer.param_groups[0]["lr"]) is float
    assert_identical([p.detach() for p in model.parameters()], [p.detach() for p in reference_model.parameters()])


@pytest.mark.parametrize("materialize", [True, False], ids=["master_grads", "model_grads"])
def test_a_step_amp_skips_without_a_host_read_leaves_the_int_step_count_as_it_was(materialize):
    model, optimizer = run("O2", fused("adamw", materialize_master_grads=materialize), steps=3,
                           inject={(1, 0)})
    assert optimizer.param_groups[0]["step"] == 2 and int(amp.skipped_steps(optimizer)) == 1
    assert optimizer.state_dict()["param_groups"][0]["step"] == 2


def test_a_step_grad_scaler_skips_leaves_the_int_step_count_as_it_was():
    model, optimizer = plain_run(fused("adamw"), steps=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(loss_of(model(batch(9)))).backward()
    poison_grad(next(model.parameters()))
    scaler.step(optimizer)
    scaler.update()
    assert optimizer.param_groups[0]["step"] == 2


def save_and_load(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("name", ["adam", "adamw"])
@pytest.mark.parametrize("direction", ["torch_to_fused", "fused_to_torch"])
def test_adam_state_dicts_translate_between_torch_and_fused_adam_bit_exactly(name, direction):
    first, then = (reference(name), fused(name)) if direction == "torch_to_fused" else (fused(name), reference(name))
    expected = trained(*plain_run(first, steps=5))
    model, optimizer = plain_run(first, steps=3)
    checkpoint = save_and_load(dict(model=model.state_dict(), optimizer=optimizer.state_dict()))
    model = net(seed=1)
    optimizer = then(model.parameters())
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    for step in range(3, 5):
        loss_of(model(batch(step))).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert_identical(trained(model, optimizer), expected)
    if direction == "torch_to_fused":
        assert optimizer.param_groups[0]["step"] == 5 and "step" not in optimizer.state[next(model.parameters())]


@pytest.mark.parametrize("option", ["amsgrad", "maximize"])
def test_fused_adam_refuses_a_torch_adam_state_dict_it_cannot_continue(option):
    model, torch_optimizer = plain_run(lambda p: torch.optim.AdamW(p, lr=0.01, **{option: True}), steps=2)
    optimizer = FusedAdam(net().parameters())
    with pytest.raises(ValueError, match=f"{option}=True"):
        optimizer.load_state_dict(torch_optimizer.state_dict())
    assert not optimizer.state and "step" not in optimizer.param_groups[0]


def test_fused_adam_refuses_torch_counts_that_differ_within_a_param_group():
    model, torch_optimizer = plain_run(reference("adamw"), steps=2)
    checkpoint = torch_optimizer.state_dict()
    checkpoint["state"][1]["step"] = torch.tensor(7.0)
    optimizer = FusedAdam(net().parameters())
    with pytest.raises(ValueError, match="stepped different numbers of times"):
        optimizer.load_state_dict(checkpoint)
    assert not optimizer.state


@pytest.mark.parametrize("name", PAIRS)
def test_grad_scaler_skip_leaves_params_state_and_step_untouched(name):
    model, optimizer = plain_run(fused(name), steps=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    before = untouched(model, optimizer)
    scaler.scale(loss_of(model(batch(9)))).backward()
    poison_grad(next(model.parameters()))
    scaler.step(optimizer)
    scaler.update()
    assert_identical(untouched(model, optimizer), before)
    assert scaler.get_scale() == 2.0


# -- under amp --------------------------------------------------------------------------------

def fused_and_reference(name, opt_level, fused_options=None, **kwargs):
    """``trained(...)`` of the fused optimizer and of its torch reference, both through amp."""
    actual = trained(*run(opt_level, fused(name, **(fused_options or {})), **kwargs))
    expected = trained(*run(opt_level, reference(name), **kwargs))
    return actual, expected


@pytest.mark.parametrize("extension", EXTENSION, ids=lambda e: "amp_C" if e else "torch")
@pytest.mark.parametrize("opt_level", EXACT_LEVELS)
@pytest.mark.parametrize("name", PAIRS)
def test_matches_the_unfused_amp_path_at_every_opt_level(name, opt_level, extension):
    with use_extension(extension):
        actual, expected = fused_and_reference(name, opt_level)
    assert_identical(actual, expected)


@pytest.mark.parametrize("name", PAIRS)
def test_o3_rounds_once_per_step_so_stays_as_close_to_fp32_as_torch(name):
    # torch's fp16 SGD / Adam round after every operation (Adam's fp16 second moment underflows);
    # the kernel computes in fp32 and rounds the param once. SGD stays within a few fp16 ulps of
    # torch's; Adam ends closer to the fp32 (O0) run than torch's does.
    fused_o3 = trained(*run("O3", fused(name)))["masters"]
    torch_o3 = trained(*run("O3", reference(name)))["masters"]
    fp32 = trained(*run("O0", reference(name)))["masters"]

    def distance(a, b):
        return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))
    if PAIRS[name][0] is FusedSGD:
        assert max(ulp_distance(a, b) for a, b in zip(fused_o3, torch_o3)) <= 8
    assert distance(fused_o3, fp32) <= distance(torch_o3, fp32)


@pytest.mark.parametrize("materialize", [True, False], ids=["master_grads", "model_grads"])
@pytest.mark.parametrize("opt_level", MASTER_LEVELS)
@pytest.mark.parametrize("name", PAIRS)
def test_both_grad_paths_under_master_weights_match_the_unfused_path(name, opt_level, materialize):
    actual, expected = fused_and_reference(name, opt_level, dict(materialize_master_grads=materialize))
    assert_identical(actual, expected)


@pytest.mark.parametrize("materialize", [True, False], ids=["master_grads", "model_grads"])
@pytest.mark.parametrize("name", PAIRS)
def test_o2_skip_leaves_params_masters_state_and_step_untouched(name, materialize):
    model, optimizer = run("O2", fused(name, materialize_master_grads=materialize), steps=2)
    before = untouched(model, optimizer)
    with amp.scale_loss(loss_of(model(batch(7))), optimizer) as scaled_loss:
        scaled_loss.backward()
        poison_grad(next(model.parameters()))
    optimizer.step()
    assert not amp.last_step_applied(optimizer)
    assert_identical(untouched(model, optimizer), before)
    assert amp.loss_scale(optimizer=optimizer) == 2.0**15


# How the gradients of the step before a step() with no new backward were consumed.
CONSUMED_BY = ["applied_step", "skipped_step", "zero_grad_keeping_tensors_after_step",
               "zero_grad_keeping_tensors_before_step", "delay_unscale_accumulation", "two_losses",
               "two_optimizers"]


def steps_with_no_backward_in_between(make_optimizer, opt_level, consumed_by):
    """Train, consume the grads as ``consumed_by`` says, then step again: what each extra step changed."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)) for _ in range(2)]
    if consumed_by != "two_optimizers":
        models = models[:1]
    optimizers = [make_optimizer(model.parameters()) for model in models]
    models, optimizers = amp.initialize(models, optimizers, opt_level=opt_level, num_losses=2, verbosity=0)
    changes = []
    for step in range(3):
        for loss_id in range(2 if consumed_by in ("two_losses", "two_optimizers") else 1):
            model = models[loss_id % len(models)]
            optimizer = optimizers[loss_id % len(models)]
            for delayed in [True, False] if consumed_by == "delay_unscale_accumulation" else [False]:
                with amp.scale_loss(loss_of(model(batch(step))), optimizer, loss_id=loss_id,
                                    delay_unscale=delayed) as scaled_loss:
                    scaled_loss.backward()
                    if consumed_by == "skipped_step" and step == 1:
                        poison_grad(next(model.parameters()))
        if consumed_by == "zero_grad_keeping_tensors_before_step":
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=False)
        for optimizer in optimizers:
            optimizer.step()
        if consumed_by == "zero_grad_keeping_tensors_after_step":
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=False)
        before = [snapshot(model, optimizer) for model, optimizer in zip(models, optimizers)]
        with pytest.warns(UserWarning, match="nothing is trained") if step == 0 else contextlib.nullcontext():
            for optimizer in optimizers:
                optimizer.step()
        after = [snapshot(model, optimizer) for model, optimizer in zip(models, optimizers)]
        changes.append((before, after))
    return changes


# O5's static loss scale checks nothing, so it skips no step.
@pytest.mark.parametrize("opt_level, consumed_by", [(level, consumed_by) for level in MASTER_LEVELS
                                                    for consumed_by in CONSUMED_BY
                                                    if level == "O2" or consumed_by != "skipped_step"])
@pytest.mark.parametrize("make", [fused("adamw", **MODEL_GRADS), fused("sgd", **MODEL_GRADS), fused("adamw"),
                                  fused("sgd"), reference("adamw")],
                         ids=["fused_adam_model_grads", "fused_sgd_model_grads", "fused_adam_master_grads",
                              "fused_sgd_master_grads", "torch_adamw"])
def test_a_step_with_no_new_backward_changes_no_master_as_the_warning_says(make, opt_level, consumed_by):
    # The model's fp16 grads that a step read stay in place (a step does not clear grads); a second
    # step() used to read them again, divide them by a scale of 1 and update every master.
    for before, after in steps_with_no_backward_in_between(make, opt_level, consumed_by):
        assert_identical(after, before)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_injected_overflows_train_as_the_unfused_path_does(name, opt_level):
    actual, expected = fused_and_reference(name, opt_level, steps=5, inject={(1, 0), (3, 0)})
    assert_identical(actual, expected)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_o2_materialized_master_grads_accumulate_as_the_unfused_path(name):
    actual, expected = fused_and_reference(name, "O2", {"materialize_master_grads": True},
                                           backward_passes=3, inject={(2, 1)})
    assert_identical(actual, expected)


@pytest.mark.parametrize("growth_interval", [2000, 1], ids=["same_scale", "scale_grows_between_passes"])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_o2_model_grads_accumulated_in_fp16_stay_within_its_rounding(name, growth_interval):
    # Without master grads, passes of one step are summed in fp16 at their common scale (the
    # smaller one, so a grown scale halves the newer grads): one fp16 rounding of the summed grad.
    actual, expected = fused_and_reference(name, "O2", MODEL_GRADS, backward_passes=3,
                                           growth_interval=growth_interval)
    torch.testing.assert_close(actual["masters"], expected["masters"], rtol=0, atol=ACCUMULATION_ATOL)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_o2_overflow_in_a_later_backward_pass_skips_the_step_and_halves_the_scale_once(name):
    model, optimizer = run("O2", fused(name, **MODEL_GRADS), steps=2, backward_passes=2)
    before = untouched(model, optimizer)
    for micro in range(2):
        with amp.scale_loss(loss_of(model(batch(20 + micro))), optimizer) as scaled_loss:
            scaled_loss.backward()
            if micro == 1:
                poison_grad(next(model.parameters()))
    optimizer.step()
    assert_identical(untouched(model, optimizer), before)
    assert amp.loss_scale(optimizer=optimizer) == 2.0**15


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_o2_overflow_in_an_earlier_pass_is_not_counted_again_by_the_next(name):
    # The inf stays in the fp16 grads that the next pass adds to; that sum is not a second overflow.
    model, optimizer = run("O2", fused(name, **MODEL_GRADS), steps=3, backward_passes=2, inject={(1, 0)})
    expected = trained(*run("O2", reference(name), steps=3, backward_passes=2, inject={(1, 0)}))
    torch.testing.assert_close(trained(model, optimizer)["masters"], expected["masters"], rtol=0,
                               atol=ACCUMULATION_ATOL)
    assert amp.loss_scale(optimizer=optimizer) == 2.0**15


def run_delayed(make_optimizer, steps=3):
    model = net()
    model, optimizer = amp.initialize(model, make_optimizer(model.parameters()), opt_level="O2", verbosity=0)
    for step in range(steps):
        for micro in range(3):
            with amp.scale_loss(loss_of(model(batch(3 * step + micro))), optimizer,
                                delay_unscale=micro < 2) as scaled_loss:
                scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_o2_delay_unscale_matches_the_unfused_path_bit_for_bit(name):
    # Delayed passes accumulate in the model's fp16 grads on both paths.
    assert_identical(trained(*run_delayed(fused(name, **MODEL_GRADS))), trained(*run_delayed(reference(name))))


@pytest.mark.parametrize("opt_level", MASTER_LEVELS)
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_checkpoint_resumes_bit_exactly_under_master_weights(name, opt_level):
    make = fused(name, **MODEL_GRADS)
    inject = {(2, 0)} if opt_level == "O2" else set()  # O5's static scale checks nothing
    expected_model, expected_optimizer = run(opt_level, make, steps=6, inject=inject)
    expected = dict(trained(expected_model, expected_optimizer), amp=amp.state_dict(optimizer=expected_optimizer))
    model, optimizer = run(opt_level, make, steps=3, inject=inject)
    buffer = io.BytesIO()
    torch.save(dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
                    amp=amp.state_dict(optimizer=optimizer)), buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    model = net(seed=1)
    model, optimizer = amp.initialize(model, make(model.parameters()), opt_level=opt_level, verbosity=0)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"], optimizer=optimizer)
    for step in range(3, 6):
        with amp.scale_loss(loss_of(model(batch(step))), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert_identical(dict(trained(model, optimizer), amp=amp.state_dict(optimizer=optimizer)), expected)


def run_clipped(make_optimizer):
    model = net()
    model, optimizer = amp.initialize(model, make_optimizer(model.parameters()), opt_level="O2", verbosity=0)
    for step in range(3):
        with amp.scale_loss(loss_of(model(batch(step))), optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 0.05)
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_o2_clipping_master_grads_without_materialized_master_grads_clips_as_apex_did(name):
    # Apex-era code clips amp.master_params(optimizer) whatever the optimizer: the masters' grads are
    # made when it reads them, for that step only.
    model, optimizer = run_clipped(fused(name, **MODEL_GRADS))
    assert_identical(trained(model, optimizer), trained(*run_clipped(reference(name))))
    assert optimizer._amp_grads_from_model  # the next step reads the model's grads again


def run_reading_master_grads_between_passes(make_optimizer):
    """Two backward passes per step, the masters' grad norm read after the first (as logging does)."""
    model = net()
    model, optimizer = amp.initialize(model, make_optimizer(model.parameters()), opt_level="O2", verbosity=0)
    norms = []
    for step in range(3):
        for micro in range(2):
            with amp.scale_loss(loss_of(model(batch(2 * step + micro))), optimizer) as scaled_loss:
                scaled_loss.backward()
            if micro == 0:
                norms.append(torch.stack([m.grad.norm() for m in amp.master_params(optimizer)]))
        optimizer.step()
        optimizer.zero_grad()
    return dict(trained(model, optimizer), norms=norms)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_master_grads_made_by_reading_them_accumulate_later_passes_as_materialized_ones_do(name):
    assert_identical(run_reading_master_grads_between_passes(fused(name, **MODEL_GRADS)),
                     run_reading_master_grads_between_passes(fused(name, materialize_master_grads=True)))


def run_clipping_a_kept_list(make_optimizer):
    """Apex-era code: the masters are listed once, and that list is clipped at every step."""
    model = net()
    model, optimizer = amp.initialize(model, make_optimizer(model.parameters()), opt_level="O2", verbosity=0)
    masters = list(amp.master_params(optimizer))
    norms = []
    for step in range(3):
        with amp.scale_loss(loss_of(model(batch(step))), optimizer) as scaled_loss:
            scaled_loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(masters, 0.05))
        optimizer.step()
        optimizer.zero_grad()
    return dict(trained(model, optimizer), norms=norms)


def test_fused_adam_by_default_gives_a_kept_list_of_master_params_their_gradients_as_apex_did():
    # Its default used to make no master grads: the kept list's clip returned 0 and clipped nothing.
    assert_identical(run_clipping_a_kept_list(fused("adamw")), run_clipping_a_kept_list(reference("adamw")))


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_without_materialized_master_grads_reading_a_kept_list_of_master_params_raises_saying_what_to_do(name):
    model = net()
    model, optimizer = amp.initialize(model, fused(name, **MODEL_GRADS)(model.parameters()), opt_level="O2",
                                      verbosity=0)
    masters = list(amp.master_params(optimizer))
    with amp.scale_loss(loss_of(model(batch(0))), optimizer) as scaled_loss:
        scaled_loss.backward()
    for read in (lambda: torch.nn.utils.clip_grad_norm_(masters, 0.05), lambda: masters[0].grad.norm(),
                 lambda: torch.nn.utils.clip_grad_norm_(optimizer.param_groups[0]["params"], 0.05)):
        with pytest.raises(RuntimeError, match=r"master of fc1\.weight has no gradient.*Iterate "
                           r"amp\.master_params\(optimizer\) again after each step's last scale_loss block"):
            read()
    # Iterating amp.master_params makes the grads; the step then trains as the unfused path does.
    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 0.05)
    optimizer.step()
    assert all(master.grad is None for master in optimizer._amp_stash.all_fp32_from_fp16_params)
    reference_model = net()
    reference_model, reference_optimizer = amp.initialize(
        reference_model, reference(name)(reference_model.parameters()), opt_level="O2", verbosity=0)
    with amp.scale_loss(loss_of(reference_model(batch(0))), reference_optimizer) as scaled_loss:
        scaled_loss.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(reference_optimizer), 0.05)
    reference_optimizer.step()
    assert_identical(trained(model, optimizer), trained(reference_model, reference_optimizer))


def test_without_materialized_master_grads_overflows_that_never_end_still_name_the_parameter():
    model = net()
    model, optimizer = amp.initialize(model, fused("adamw", **MODEL_GRADS)(model.parameters()), opt_level="O2",
                                      max_consecutive_skips=2, verbosity=0)
    with pytest.raises(amp.NonFiniteGradientsError, match=r"not finite: fc1\.weight"):
        run_steps = range(3)
        for step in run_steps:
            with amp.scale_loss(loss_of(model(batch(step))), optimizer) as scaled_loss:
                scaled_loss.backward()
                poison_grad(model.fc1.weight)
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_o2_clipping_master_grads_works_with_materialized_master_grads(name):
    actual = trained(*run_clipped(fused(name, materialize_master_grads=True)))
    assert_identical(actual, trained(*run_clipped(reference(name))))
    unclipped = trained(*run("O2", fused(name, materialize_master_grads=True), steps=3))
    assert not torch.equal(actual["masters"][0], unclipped["masters"][0])


@pytest.mark.parametrize("opt_level", MASTER_LEVELS)
def test_model_grads_path_makes_no_fp32_master_grads_and_writes_the_model_copy(opt_level):
    model, optimizer = run(opt_level, fused("adamw", **MODEL_GRADS), steps=1)
    with amp.scale_loss(loss_of(model(batch(5))), optimizer) as scaled_loss:
        scaled_loss.backward()
    stash = optimizer._amp_stash
    assert all(isinstance(master.grad, UnmadeGrad) for master in stash.all_fp32_from_fp16_params)
    assert all(buffer is None for buffer in stash.master_grad_buffers)
    assert all(param.grad.dtype == LOW_DTYPE[opt_level] for param in stash.all_fp16_params)
    optimizer.step()
    for param, master in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
        assert torch.equal(param, master.to(param.dtype))


# -- Apex's test_fused_sgd: several models, losses and optimizers, inf injected ---------------

def run_scenario(scenario, make_sgd, inject):
    count, losses, owners, loss_optimizers = SCENARIOS[scenario]
    models = [Product(unique) for unique in range(count)]
    optimizers = [make_sgd([{"params": list(models[m].parameters()), "lr": 0.25 * (1 + m % 2)} for m in owned])
                  for owned in owners]
    models, optimizers = amp.initialize(models, optimizers, opt_level="O2", num_losses=2, verbosity=0)
    applied = []
    for iteration in range(3):
        for k, members in enumerate(losses):
            loss = sum(models[m](inputs(iteration, k)) for m in members)
            with amp.scale_loss(loss, [optimizers[i] for i in loss_optimizers[k]], loss_id=k) as scaled_loss:
                scaled_loss.backward()
                if inject is not None and inject[:2] == (iteration, k):
                    poison_grad(models[inject[2]].weight0)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        applied.append([bool(amp.last_step_applied(opt)) for opt in optimizers])
    return [p.detach() for opt in optimizers for p in amp.master_params(opt)], applied


@pytest.mark.parametrize("materialize", [True, False], ids=["master_grads", "model_grads"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_apex_fused_sgd_scenarios_match_the_unfused_path(scenario, materialize):
    def fused_sgd(groups):
        return FusedSGD(groups, lr=0.1, momentum=0.125, materialize_master_grads=materialize)

    def torch_sgd(groups):
        return torch.optim.SGD(groups, lr=0.1, momentum=0.125, foreach=False)

    _, losses, _, _ = SCENARIOS[scenario]
    for inject in [None, (0, 0, losses[0][0]), (1, 1, losses[1][-1])]:
        actual, actual_applied = run_scenario(scenario, fused_sgd, inject)
        expected, expected_applied = run_scenario(scenario, torch_sgd, inject)
        assert actual_applied == expected_applied
        if materialize:
            assert_identical(actual, expected)
        else:
            torch.testing.assert_close(actual, expected, rtol=0, atol=ACCUMULATION_ATOL)


# The pure-PyTorch ops round their host coefficients to fp32 through CPU tensors (.item() on a
# host value, no device read), which the counter below cannot tell from a device read.
@pytest.mark.skipif(not MultiTensorApply.available, reason="needs amp_C: the fallback's host-side "
                    "coefficient rounding reads CPU tensors")
@pytest.mark.parametrize("opt_level", ["O1", "O2", "O5"])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_steps_read_nothing_on_the_host_once_state_exists(name, opt_level):
    model, optimizer = run(opt_level, fused(name, **MODEL_GRADS), steps=1, backward_passes=2)
    with use_extension(True), count_host_reads() as reads:
        for step in range(1, 4):
            for micro in range(2):
                with amp.scale_loss(loss_of(model(batch(2 * step + micro))), optimizer) as scaled_loss:
                    scaled_loss.backward()
                    if step == 2 and micro == 0 and opt_level != "O5":
                        poison_grad(next(model.parameters()))
            optimizer.step()
            optimizer.zero_grad()
    assert reads == []
    assert int(amp.skipped_steps(optimizer)) == (opt_level != "O5")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("poison", [None, "nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_the_read_only_overflow_check_finds_the_peak_magnitude(dtype, poison, where):
    # The check at the scale_loss exit of a fused step without master grads: its CPU path (aminmax
    # per tensor) against torch's inf-norm over the whole list, empty tensors among them.
    from amp._compat import foreach_norm  # torch's _foreach_norm has no dtype before 2.4
    from amp._controller.fused import _peak_magnitude
    gen = torch.Generator().manual_seed(3)
    grads = [(torch.randn(n, generator=gen) * 100).to(dtype) for n in (0, 5, 70000, 0, 1, 3000)]
    grads[2][123] = -30000.0  # the peak, negative
    if poison is not None:
        target = {"first": grads[1], "middle": grads[2], "last": grads[5]}[where]
        target[{"first": 0, "middle": target.numel() // 2, "last": -1}[where]] = float(poison)
    non_empty = [g for g in grads if g.numel() > 0]  # torch's inf-norm refuses an empty tensor
    expected = torch.stack(foreach_norm(non_empty, float("inf"), dtype=torch.float32)).amax()
    ours = _peak_magnitude(grads)
    assert ours.dtype == torch.float32 and ours.dim() == 0
    assert torch.equal(ours, expected) or (ours.isnan() and expected.isnan())
    if poison is None:
        assert ours.item() == -grads[2][123].float().item()
    assert _peak_magnitude([torch.empty(0, dtype=dtype)]).item() == 0.0


@pytest.mark.parametrize("opt_level", ["O2", "O5"])
def test_an_empty_parameter_does_not_break_the_fused_step(opt_level):
    # The read-only overflow check used to call torch's inf-norm, which refuses an empty tensor.
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    model.register_parameter("empty", nn.Parameter(torch.zeros(0)))
    before = model.weight.detach().clone()
    model, optimizer = amp.initialize(model, FusedAdam(model.parameters(), lr=0.1), opt_level=opt_level,
                                      loss_scale="dynamic", verbosity=0)
    x = torch.randn(2, 4).to(LOW_DTYPE[opt_level])
    loss = model(x).float().sum() * 1e-4 + model.empty.float().sum()  # no overflow at 2**16
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert amp.last_step_applied(optimizer)
    assert not torch.equal(model.weight.float(), before.to(model.weight.dtype).float())
