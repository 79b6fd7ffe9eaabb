"""Recipes of Apex-era training scripts that reach into Apex's internals, each against the same run
done the plain way (an uninterrupted run, or torch arithmetic on the same data).

NVIDIA's BERT pretraining (DeepLearningExamples, ``run_pretraining.py``) resumes under O2 by
loading the optimizer around Apex's lazy init and copying saved masters into
``amp.master_params``; with ``--allreduce_post_accumulation`` it checks the gradients itself and
hands its overflow flag to the loss scaler. GNMT reads the scale through ``_amp_state``.
"""
import copy
import io

import pytest
import torch

import amp
from amp.optimizers import FusedAdam
from amp_common import assert_identical, batch, loss_of, net, poison_grad

STEPS, SAVE_AFTER = 6, 3
OPTIMIZERS = {"adamw": lambda params: torch.optim.AdamW(params, lr=0.01, eps=1e-4),
              "fused_adam": lambda params: FusedAdam(params, lr=0.01, eps=1e-4)}


def bert_run(make_optimizer, seed=0):
    model = net(seed)
    return amp.initialize(model, make_optimizer(model.parameters()), opt_level="O2", verbosity=0)


def train(model, optimizer, steps, inject=()):
    for step in steps:
        with amp.scale_loss(loss_of(model(batch(step))), optimizer) as scaled_loss:
            scaled_loss.backward()
            if step in inject:
                poison_grad(next(model.parameters()))
        optimizer.step()
        optimizer.zero_grad()


def through_torch_save(checkpoint):
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def state(model, optimizer):
    return dict(model=copy.deepcopy(model.state_dict()), masters=[p.detach().clone() for p in amp.master_params(optimizer)],
                optimizer=optimizer.state_dict()["state"], scale=amp.loss_scaler(optimizer=optimizer).state_dict())


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_nvidias_bert_resume_through_apexs_lazy_init_continues_bit_exactly(name):
    make = OPTIMIZERS[name]
    model, optimizer = bert_run(make)
    train(model, optimizer, range(STEPS), inject={1})
    expected = state(model, optimizer)

    model, optimizer = bert_run(make)
    train(model, optimizer, range(SAVE_AFTER), inject={1})
    checkpoint = through_torch_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                     "master params": list(amp.master_params(optimizer)), "amp": amp.state_dict()})
    del model, optimizer

    model = net(seed=1)
    model.load_state_dict(checkpoint["model"], strict=False)
    optimizer = make(model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    optimizer.load_state_dict(checkpoint["optimizer"])
    optimizer._lazy_init_maybe_master_weights()
    optimizer._amp_stash.lazy_init_called = True
    optimizer.load_state_dict(checkpoint["optimizer"])
    for param, saved_param in zip(amp.master_params(optimizer), checkpoint["master params"]):
        param.data.copy_(saved_param.data)
    amp.load_state_dict(checkpoint["amp"])
    train(model, optimizer, range(SAVE_AFTER, STEPS))
    assert_identical(state(model, optimizer), expected)


def test_apexs_lazy_init_after_initialize_leaves_the_masters_in_the_optimizer():
    model, optimizer = bert_run(OPTIMIZERS["adamw"])
    masters = list(amp.master_params(optimizer))
    optimizer._amp_stash.lazy_init_called = False
    optimizer._amp_lazy_init()
    optimizer._lazy_init_maybe_master_weights()
    assert [p is q for p, q in zip(amp.master_params(optimizer), masters)] == [True] * len(masters)
    before = [p.detach().clone() for p in model.parameters()]
    train(model, optimizer, range(1))
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before) if p.requires_grad)


def bert_post_accumulation_step(model, optimizer, step, inject=False, accumulation=2):
    """``take_optimizer_step`` with ``allreduce_post_accumulation`` (one process: no all-reduce)."""
    for micro in range(accumulation):
        loss = loss_of(model(batch(accumulation * step + micro)))
        with amp.scale_loss(loss, optimizer, delay_overflow_check=True) as scaled_loss:
            scaled_loss.backward()
            if inject and micro == 1:
                poison_grad(next(model.parameters()))
    scaler = amp._amp_state.loss_scalers[0]
    loss_scale = scaler.loss_scale()
    master_grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
    overflow_buf = torch.zeros(1, dtype=torch.int)
    flat = torch.empty(sum(g.numel() for g in master_grads))
    views, offset = [], 0
    for grad in master_grads:
        views.append(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    torch._foreach_copy_(views, [g * (loss_scale / accumulation) for g in master_grads])
    overflow_buf.fill_(int(not bool(torch.isfinite(flat).all())))
    torch._foreach_copy_(master_grads, [v * (1.0 / loss_scale) for v in views])
    scaler._overflow_buf = overflow_buf
    if scaler.update_scale() == 0:
        optimizer.step()
    else:
        for param in optimizer._amp_stash.all_fp32_from_fp16_params:
            param.grad = None
    for param in model.parameters():
        param.grad = None


def test_bert_post_accumulation_hands_its_overflow_flag_to_the_scaler_and_skips_that_step():
    model, optimizer = bert_run(OPTIMIZERS["fused_adam"])
    bert_post_accumulation_step(model, optimizer, 0)
    before = state(model, optimizer)
    bert_post_accumulation_step(model, optimizer, 1, inject=True)
    after = state(model, optimizer)
    assert after["scale"]["loss_scale"] == before["scale"]["loss_scale"] / 2
    del before["scale"], after["scale"], before["model"], after["model"]
    assert_identical(after, before)
    assert optimizer.param_groups[0]["step"] == 1


def test_bert_post_accumulation_trains_as_the_same_sums_in_plain_torch():
    model, optimizer = bert_run(OPTIMIZERS["fused_adam"])
    reference = net()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, eps=1e-4)
    for step in range(3):
        bert_post_accumulation_step(model, optimizer, step)
        for micro in range(2):
            (loss_of(reference(batch(2 * step + micro))) / 2).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    # fp16 weights and activations against fp32: the O2 tolerance of a few steps.
    for master, param in zip(amp.master_params(optimizer), reference.parameters()):
        torch.testing.assert_close(master, param.detach(), rtol=2e-2, atol=2e-3)


def test_the_overflow_flag_handed_over_must_be_one_element():
    model, optimizer = bert_run(OPTIMIZERS["adamw"])
    with pytest.raises(TypeError, match="one-element tensor"):
        amp._amp_state.loss_scalers[0]._overflow_buf = torch.zeros(2)


def test_gnmt_reads_the_loss_scale_through_amp_state():
    from amp import _amp_state

    model, optimizer = bert_run(OPTIMIZERS["adamw"])
    train(model, optimizer, range(2), inject={1})
    assert _amp_state.loss_scalers[0].loss_scale() == amp.loss_scale(optimizer=optimizer) == 2.0**15
