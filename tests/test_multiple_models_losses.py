"""Several models, optimizers and losses (Apex's run_amp scenarios), with inf injected at every position.

Each model computes ``sum(x * w0 * w1)`` in fp32 (O0 with a dynamic scale, O1, and O2 with
``cast_model_type=False`` as Apex's own tests did), so the amp run must equal a plain fp32 SGD
run bit for bit, where the reference skips exactly the optimizers passed to the overflowing
``scale_loss`` on that iteration.
"""
import pytest
import torch
from torch import nn

import amp
from amp_common import assert_identical, poison_grad

ITERATIONS = 3
LEVELS = {"O0": dict(loss_scale="dynamic"), "O1": {}, "O2": dict(cast_model_type=False)}

# name -> (number of models, models in each loss, models owned by each optimizer,
#          optimizers passed to each loss's scale_loss)
SCENARIOS = {
    "2models2losses1optimizer": (2, [[0], [1]], [[0, 1]], [[0], [0]]),
    "3models2losses1optimizer": (3, [[0, 2], [1, 2]], [[0, 1, 2]], [[0], [0]]),
    "2models2losses2optimizers": (2, [[0], [1]], [[0], [1]], [[0], [1]]),
    "3models2losses2optimizers": (3, [[0, 1], [2, 1]], [[0, 1], [2]], [[0], [0, 1]]),
}


class Product(nn.Module):
    def __init__(self, unique):
        super().__init__()
        self.weight0 = nn.Parameter(torch.arange(4.0) + unique)
        self.weight1 = nn.Parameter(torch.arange(4.0) * 0.5 + 2 * unique)

    def forward(self, x):
        return (x * self.weight0 * self.weight1).sum()


def inputs(iteration, loss_index):
    return torch.randn(4, generator=torch.Generator().manual_seed(10 * iteration + loss_index))


def build(scenario):
    count, _, owners, _ = SCENARIOS[scenario]
    models = [Product(unique) for unique in range(count)]
    optimizers = [torch.optim.SGD([{"params": list(models[m].parameters()), "lr": 0.25 * (1 + m % 2)}
                                   for m in owned], lr=0.1, momentum=0.125) for owned in owners]
    return models, optimizers


def zero(models, optimizers, how):
    if how == "optimizer":
        for optimizer in optimizers:
            optimizer.zero_grad()
    elif how == "model":
        for model in models:
            model.zero_grad()
    else:
        for param in (p for model in models for p in model.parameters()):
            param.grad = None


def run_amp(scenario, opt_level, inject, num_losses, zero_with="optimizer"):
    _, losses, _, loss_optimizers = SCENARIOS[scenario]
    models, optimizers = build(scenario)
    models, optimizers = amp.initialize(models, optimizers, opt_level=opt_level, num_losses=num_losses,
                                        verbosity=0, **LEVELS[opt_level])
    applied = []
    for iteration in range(ITERATIONS):
        for k, members in enumerate(losses):
            loss = sum(models[m](inputs(iteration, k)) for m in members)
            passed = [optimizers[i] for i in loss_optimizers[k]]
            with amp.scale_loss(loss, passed, loss_id=k % num_losses) as scaled_loss:
                scaled_loss.backward()
                if inject is not None and inject[:2] == (iteration, k):
                    poison_grad(models[inject[2]].weight0)
        for optimizer in optimizers:
            optimizer.step()
        applied.append([bool(amp.last_step_applied(opt)) for opt in optimizers])
        zero(models, optimizers, zero_with)
    return [p.detach().clone() for model in models for p in model.parameters()], applied


def run_reference(scenario, inject):
    _, losses, _, loss_optimizers = SCENARIOS[scenario]
    models, optimizers = build(scenario)
    applied = []
    for iteration in range(ITERATIONS):
        for k, members in enumerate(losses):
            sum(models[m](inputs(iteration, k)) for m in members).backward()
        skip = set(loss_optimizers[inject[1]]) if inject is not None and inject[0] == iteration else set()
        for index, optimizer in enumerate(optimizers):
            if index not in skip:
                optimizer.step()
        applied.append([index not in skip for index in range(len(optimizers))])
        zero(models, optimizers, "optimizer")
    return [p.detach().clone() for model in models for p in model.parameters()], applied


def injections(scenario):
    """None, then (iteration, loss, model) for every model of every loss at iterations 0 and 1."""
    _, losses, _, _ = SCENARIOS[scenario]
    return [None] + [(iteration, k, m) for iteration in (0, 1) for k, members in enumerate(losses)
                     for m in members]


CASES = [pytest.param(scenario, inject, id=f"{scenario}-{'clean' if inject is None else 'inf@it%d,loss%d,model%d' % inject}")
         for scenario in SCENARIOS for inject in injections(scenario)]


@pytest.mark.parametrize("num_losses", [1, 2], ids=["shared_scaler", "scaler_per_loss"])
@pytest.mark.parametrize("opt_level", list(LEVELS))
@pytest.mark.parametrize("scenario, inject", CASES)
def test_overflow_skips_only_the_optimizers_of_the_overflowing_loss(scenario, inject, opt_level, num_losses):
    params, applied = run_amp(scenario, opt_level, inject, num_losses)
    expected_params, expected_applied = run_reference(scenario, inject)
    assert applied == expected_applied
    assert_identical(params, expected_params)


@pytest.mark.parametrize("zero_with", ["model", "none"])
def test_zeroing_through_the_model_or_by_hand_gives_the_same_training(zero_with):
    inject = (1, 1, 1)
    params, applied = run_amp("2models2losses2optimizers", "O2", inject, 2, zero_with)
    expected_params, expected_applied = run_reference("2models2losses2optimizers", inject)
    assert applied == expected_applied
    assert_identical(params, expected_params)
