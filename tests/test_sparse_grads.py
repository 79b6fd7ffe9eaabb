"""Sparse gradients (``nn.Embedding(sparse=True)``) are unscaled, checked and accumulated like dense ones."""
import copy

import pytest
import torch
from torch import nn

import amp
from amp_common import TOLERANCES

LEVELS = {"O0": dict(loss_scale="dynamic"), "O1": {}, "O2": {}, "O5": {}}
# A dynamic fp16 run skips its first steps while the scale settles; this one never overflows.
SETTLED = {"O0": dict(loss_scale="dynamic"), "O1": dict(loss_scale=128.0),
           "O2": dict(loss_scale=128.0), "O5": {}}
TOLERANCE = {"O0": dict(rtol=1e-6, atol=1e-7), "O1": TOLERANCES[torch.float16],
             "O2": TOLERANCES[torch.float16], "O5": TOLERANCES[torch.bfloat16]}
OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=0.5),
              "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1)}


def model_and_tokens():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8, sparse=True), nn.Linear(8, 1))
    tokens = [torch.randint(0, 20, (12,), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    return model, tokens


def loss_of(model, tokens):
    return model(tokens).float().pow(2).mean()


# torch's own sparse Adagrad step says this about itself; it is not about amp.
@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled:UserWarning")
@pytest.mark.parametrize("make_optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("opt_level", list(LEVELS))
def test_sparse_embedding_trains_like_fp32_with_accumulation(opt_level, make_optimizer):
    model, tokens = model_and_tokens()
    reference = copy.deepcopy(model)
    reference_opt = OPTIMIZERS[make_optimizer](reference.parameters())
    optimizer = OPTIMIZERS[make_optimizer](model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0,
                                      **SETTLED[opt_level])
    for step in range(2):
        # Two micro-batches per step: the second backward accumulates onto the first.
        for tokens_half in (tokens[2 * step], tokens[2 * step + 1]):
            with amp.scale_loss(loss_of(model, tokens_half), optimizer) as scaled_loss:
                scaled_loss.backward()
            loss_of(reference, tokens_half).backward()
        optimizer.step()
        optimizer.zero_grad()
        reference_opt.step()
        reference_opt.zero_grad()
    torch.testing.assert_close([p.detach().float() for p in amp.master_params(optimizer)],
                               [p.detach() for p in reference.parameters()], **TOLERANCE[opt_level])


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2"])
def test_a_non_finite_sparse_grad_skips_the_step(opt_level):
    model, tokens = model_and_tokens()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0,
                                      **LEVELS[opt_level])
    before = [p.detach().clone() for p in amp.master_params(optimizer)]
    with amp.scale_loss(loss_of(model, tokens[0]), optimizer) as scaled_loss:
        scaled_loss.backward()
        grad = model[0].weight.grad
        assert grad.is_sparse
        with torch.no_grad():
            grad._values().view(-1)[-1] = float("nan")
    optimizer.step()
    assert not bool(amp.last_step_applied(optimizer))
    for param, old in zip(amp.master_params(optimizer), before):
        assert torch.equal(param.detach(), old)


def test_an_endless_sparse_overflow_names_the_embedding():
    model, tokens = model_and_tokens()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0,
                                      max_consecutive_skips=2)
    with pytest.raises(amp.NonFiniteGradientsError, match=r"0\.weight"):
        for step in range(4):
            with amp.scale_loss(loss_of(model, tokens[step]), optimizer) as scaled_loss:
                scaled_loss.backward()
                with torch.no_grad():
                    model[0].weight.grad._values().view(-1)[0] = float("inf")
            optimizer.step()
