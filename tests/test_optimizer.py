"""What initialize does to optimizers: _amp_stash, fp32 masters, patched methods, and the exact skip."""
import warnings

import pytest
import torch

import amp
from amp_common import (LOW_DTYPE, MASTER_LEVELS, assert_identical, batch, initialized, loss_of,
                        needs_fused, net, poison_grad, sgd, snapshot, train_step)


def test_initialize_attaches_an_amp_stash():
    _, optimizer = initialized("O1")
    stash = optimizer._amp_stash
    assert stash.lazy_init_called and not stash.already_patched and not stash.params_have_scaled_gradients


@pytest.mark.parametrize("opt_level", MASTER_LEVELS)
def test_masters_are_fp32_copies_of_the_exact_initial_values(opt_level):
    reference = [p.detach().clone() for p in net().parameters()]
    model, optimizer = initialized(opt_level)
    masters = list(amp.master_params(optimizer))
    assert [m.dtype for m in masters] == [torch.float32] * len(reference)
    assert_identical(masters, reference)
    assert model.fc1.weight.dtype == LOW_DTYPE[opt_level]
    assert masters[0] is not model.fc1.weight


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O3", "O4"])
def test_master_params_are_the_model_params_without_master_weights(opt_level):
    model, optimizer = initialized(opt_level)
    assert all(a is b for a, b in zip(amp.master_params(optimizer), model.parameters()))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_accepts_set_to_none(opt_level, set_to_none):
    model, optimizer = initialized(opt_level)
    loss = loss_of(model(batch(0)))
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.zero_grad(set_to_none=set_to_none)
    for param in list(model.parameters()) + list(amp.master_params(optimizer)):
        if param.dtype != torch.float32 or set_to_none or param not in set(model.parameters()):
            assert param.grad is None or not param.grad.any()
        else:
            assert param.grad is not None and not param.grad.any()


def test_add_param_group_gives_the_new_group_fp32_masters_under_o2():
    model = net()
    optimizer = sgd(model.fc1.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    optimizer.add_param_group({"params": list(model.fc2.parameters()), "lr": 0.5})
    new_group = optimizer.param_groups[1]["params"]
    assert [p.dtype for p in new_group] == [torch.float32, torch.float32]
    assert new_group[0] is not model.fc2.weight
    assert torch.equal(new_group[0].half(), model.fc2.weight)
    train_step(model, optimizer, 0)
    assert torch.equal(new_group[0].half(), model.fc2.weight)


def test_step_is_wrapped_once_and_stays_the_same_object_across_overflows():
    model, optimizer = initialized("O2")
    step = optimizer.step
    train_step(model, optimizer, 0, inject=True)
    assert optimizer.step is step
    train_step(model, optimizer, 1)
    assert optimizer.step is step


def run_with_scheduler(scheduler_first):
    model = net()
    optimizer = sgd(model.parameters())
    if scheduler_first:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    if not scheduler_first:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            train_step(model, optimizer, step, inject=step == 0)
            scheduler.step()
    return caught, optimizer


@pytest.mark.parametrize("scheduler_first", [True, False], ids=["scheduler_before", "scheduler_after"])
def test_step_lr_works_without_warnings_when_the_first_step_is_skipped(scheduler_first):
    caught, optimizer = run_with_scheduler(scheduler_first)
    assert [str(w.message) for w in caught] == []
    assert int(amp.skipped_steps(optimizer)) == 1
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_an_lr_scheduler_of_torch_before_2_4_finds_its_mark_and_count_after_a_skipped_step():
    model = net()
    optimizer = sgd(model.parameters())
    # What an LR scheduler of torch < 2.4 did to optimizer.step when it was constructed.
    original_step = optimizer.step

    def with_counter(*args, **kwargs):
        optimizer._step_count += 1
        return original_step(*args, **kwargs)
    with_counter._with_counter = True
    optimizer.step, optimizer._step_count = with_counter, 0
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    assert getattr(optimizer.step, "_with_counter", False)
    assert not hasattr(optimizer.step, "_wrapped_by_lr_sched")
    train_step(model, optimizer, 0, inject=True)
    assert int(amp.skipped_steps(optimizer)) == 1 and optimizer._step_count == 1
    train_step(model, optimizer, 1)
    assert int(amp.skipped_steps(optimizer)) == 1 and optimizer._step_count == 2


def test_step_hooks_fire_on_applied_steps_only():
    model, optimizer = initialized("O2")
    calls = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    train_step(model, optimizer, 0)
    train_step(model, optimizer, 1, inject=True)  # skipped: the optimizer is never called
    train_step(model, optimizer, 2)
    assert calls == ["pre", "post", "pre", "post"]


def test_closure_is_rejected_under_master_weights():
    model, optimizer = initialized("O2")
    with pytest.raises(RuntimeError, match="closure"):
        optimizer.step(lambda: 0.0)


OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01, foreach=False),
    "adam_foreach": lambda params: torch.optim.Adam(params, lr=0.01, foreach=True),
    "adam_fused": lambda params: torch.optim.Adam(params, lr=0.01, fused=True),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, foreach=False),
    "adamw_foreach": lambda params: torch.optim.AdamW(params, lr=0.01, foreach=True),
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=0.01, fused=True),
}


FUSED = {"adam_fused": needs_fused(torch.optim.Adam), "adamw_fused": needs_fused(torch.optim.AdamW)}


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("name", [pytest.param(name, marks=FUSED.get(name, ())) for name in OPTIMIZERS])
def test_overflow_skips_the_next_step_exactly(opt_level, name):
    model, optimizer = initialized(opt_level, OPTIMIZERS[name])
    train_step(model, optimizer, 0)
    before = snapshot(model, optimizer)
    loss = loss_of(model(batch(1)))
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
        poison_grad(model.fc2.bias, float("nan"))
    optimizer.step()
    after = snapshot(model, optimizer)
    # BN running statistics legitimately moved in the forward pass; everything the step owns did not.
    before["model"] = {k: v for k, v in before["model"].items() if "running" not in k and "batches" not in k}
    after["model"] = {k: v for k, v in after["model"].items() if k in before["model"]}
    assert_identical(after, before)
    assert not bool(amp.last_step_applied(optimizer))
    assert int(amp.skipped_steps(optimizer)) == 1
    if opt_level in MASTER_LEVELS:
        assert all(m.grad is None for m in optimizer._amp_stash.all_fp32_from_fp16_params)


@pytest.mark.parametrize("name", [pytest.param(name, marks=mark) for name, mark in FUSED.items()])
def test_fused_optimizers_take_the_sync_free_found_inf_path(name, monkeypatch):
    model, optimizer = initialized("O2", OPTIMIZERS[name])
    assert optimizer._step_supports_amp_scaling
    seen = []
    original = optimizer._amp_stash.original_step

    def spy(*args, **kwargs):
        seen.append(float(optimizer.found_inf))
        return original(*args, **kwargs)
    monkeypatch.setattr(optimizer._amp_stash, "original_step", spy)
    train_step(model, optimizer, 0, inject=True)
    train_step(model, optimizer, 1)
    assert seen == [1.0, 0.0]
    assert [bool(amp.last_step_applied(optimizer)), int(amp.skipped_steps(optimizer))] == [True, 1]


def test_step_counts_are_readable_through_last_step_applied_and_skipped_steps():
    model, optimizer = initialized("O1")
    applied = []
    for step, inject in enumerate([False, True, True, False]):
        train_step(model, optimizer, step, inject=inject)
        applied.append(bool(amp.last_step_applied(optimizer)))
    assert applied == [True, False, False, True]
    assert int(amp.skipped_steps(optimizer)) == 2


def _bookkeeping(optimizer):
    stash = optimizer._amp_stash
    return ({name: list(value) for name, value in vars(stash).items() if isinstance(value, list)},
            [list(group["params"]) for group in optimizer.param_groups])


def _bad_groups(model):
    counter = torch.zeros(2, dtype=torch.int64)
    return {
        "duplicate of a tracked param": lambda: {"params": [model.fc1.weight]},
        "same param twice": lambda: {"params": [model.fc2.weight, model.fc2.weight]},
        "int param": lambda: {"params": [model.fc2.weight, counter]},
        "float64 param": lambda: {"params": [model.fc2.bias, torch.zeros(2, dtype=torch.float64)]},
        "non-leaf": lambda: {"params": [model.fc2.weight * 2]},
        "not a tensor": lambda: {"params": [model.fc2.weight, "bias"]},
        "no params": lambda: {"lr": 0.1},
    }


@pytest.mark.parametrize("case", list(_bad_groups(None)))
@pytest.mark.parametrize("opt_level", ["O1", "O2", "O5"])
def test_a_rejected_add_param_group_changes_nothing_and_training_goes_on(opt_level, case):
    def build():
        model = net()
        optimizer = sgd(model.fc1.parameters())
        return amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)

    reference_model, reference_opt = build()
    reference_opt.add_param_group({"params": list(reference_model.fc2.parameters())})
    model, optimizer = build()
    before = _bookkeeping(optimizer)
    with pytest.raises((TypeError, ValueError)):
        optimizer.add_param_group(_bad_groups(model)[case]())
    after = _bookkeeping(optimizer)
    assert after[1] == before[1]
    assert {k: [id(p) for p in v] for k, v in after[0].items()} == \
        {k: [id(p) for p in v] for k, v in before[0].items()}

    optimizer.add_param_group({"params": list(model.fc2.parameters())})
    for step in range(3):
        inject = step == 1 and opt_level != "O5"  # O5's static scale checks nothing
        train_step(reference_model, reference_opt, step, inject=inject)
        train_step(model, optimizer, step, inject=inject)
    assert_identical([p.detach() for p in amp.master_params(optimizer)],
                     [p.detach() for p in amp.master_params(reference_opt)])
