"""amp.optimizers.FusedLAMB and amp_C.multi_tensor_lamb: the paper's formula, both paths, amp.

The reference is LAMB written from the paper (You et al., 2019) the way Apex's kernel reads it
(global-norm clipping, Adam's moments, per-tensor trust ratio where the tensor is decayed or with
NVLAMB), per tensor in fp64 with plain PyTorch; the fused step runs in fp32, so they agree within
fp32 rounding. amp_C and the PyTorch fallback must agree bit for bit.
"""
import copy
import io
import math

import pytest
import torch
from torch import nn

import amp
from amp import _pytorch_ops
from amp.check.kernel_cases import _adam_forms
from amp.multi_tensor_apply import amp_C
from amp.optimizers import FusedLAMB
from amp_common import assert_identical, batch, loss_of, net, poison_grad

needs_amp_C = pytest.mark.skipif(amp_C is None, reason="amp_C is not built")
CHUNK = 64  # small, so that tensors straddle chunks
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.cuda))


def kernel_device(device):
    if device == "cuda" and not amp_C.cuda_available():
        pytest.skip("amp_C has no CUDA kernels here, or no GPU is visible")
    return device


# ---- the reference: the paper's LAMB, as Apex applies it ---------------------------------------


class ReferenceLAMB:
    """LAMB per tensor in fp64: each group's options as FusedLAMB's, Apex's global clipping."""

    def __init__(self, groups, lr, betas, eps, adam_w_mode, grad_averaging, max_grad_norm, use_nvlamb,
                 bias_correction=True):
        self.groups = [(list(group["params"]), group.get("weight_decay", 0.0)) for group in groups]
        self.lr, self.betas, self.eps = lr, betas, eps
        self.adam_w_mode, self.grad_averaging = adam_w_mode, grad_averaging
        self.max_grad_norm, self.use_nvlamb, self.bias_correction = max_grad_norm, use_nvlamb, bias_correction
        self.masters = {p: p.detach().double().clone() for params, _ in self.groups for p in params}
        self.m = {p: torch.zeros_like(m) for p, m in self.masters.items()}
        self.v = {p: torch.zeros_like(m) for p, m in self.masters.items()}
        self.step_number = 0

    def step(self):
        self.step_number += 1
        beta1, beta2 = self.betas
        grads = {p: p.grad.double() for params, _ in self.groups for p in params if p.grad is not None}
        global_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
        clip = global_norm / self.max_grad_norm if global_norm > self.max_grad_norm else 1.0
        bc1 = 1 - beta1**self.step_number if self.bias_correction else 1.0
        bc2 = 1 - beta2**self.step_number if self.bias_correction else 1.0
        for params, wd in self.groups:
            for p in params:
                if p not in grads:
                    continue
                w = self.masters[p]
                g = grads[p] / clip
                if not self.adam_w_mode and wd:
                    g = g + wd * w
                self.m[p] = beta1 * self.m[p] + ((1 - beta1) if self.grad_averaging else 1.0) * g
                self.v[p] = beta2 * self.v[p] + (1 - beta2) * g * g
                update = (self.m[p] / bc1) / ((self.v[p] / bc2).sqrt() + self.eps)
                if self.adam_w_mode and wd:
                    update = update + wd * w
                ratio = self.lr
                if wd or self.use_nvlamb:
                    w_norm, u_norm = float(w.norm()), float(update.norm())
                    if w_norm and u_norm:
                        ratio = self.lr * w_norm / u_norm
                self.masters[p] = w - ratio * update
                with torch.no_grad():
                    p.copy_(self.masters[p])


class Tower(nn.Module):
    """Two linears and a bias-free one: tensors of several sizes, some undecayed (biases)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 2, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))


def groups_of(model, wd):
    """Apex-era BERT's groups: weight decay on the weights, none on the biases."""
    decayed = [p for name, p in model.named_parameters() if not name.endswith("bias")]
    plain = [p for name, p in model.named_parameters() if name.endswith("bias")]
    return [{"params": decayed, "weight_decay": wd}, {"params": plain, "weight_decay": 0.0}]


OPTIONS = [
    dict(adam_w_mode=True, grad_averaging=True, use_nvlamb=False, max_grad_norm=1.0),
    dict(adam_w_mode=False, grad_averaging=True, use_nvlamb=False, max_grad_norm=1.0),
    dict(adam_w_mode=True, grad_averaging=False, use_nvlamb=True, max_grad_norm=0.05),
    dict(adam_w_mode=True, grad_averaging=True, use_nvlamb=False, max_grad_norm=float("inf")),
    dict(adam_w_mode=False, grad_averaging=False, use_nvlamb=True, max_grad_norm=1e-3, bias_correction=False),
]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_fused_lamb_follows_the_papers_formula(options):
    torch.manual_seed(0)
    model, twin = Tower(), None
    twin = copy.deepcopy(model)
    settings = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-6, **options)
    optimizer = FusedLAMB(groups_of(model, 0.01), **settings)
    reference = ReferenceLAMB(groups_of(twin, 0.01), **settings)
    for step in range(6):
        for m in (model, twin):
            m.zero_grad()
            loss_of(m(batch(step))).backward()
        optimizer.step()
        reference.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, rtol=2e-5, atol=2e-6)
    assert all(group["step"] == 6 and type(group["step"]) is int for group in optimizer.param_groups)


def test_the_trust_ratio_applies_only_to_decayed_tensors_without_nvlamb():
    """With a huge ratio the decayed tensor moves by about lr * |p| in norm, the bias by about lr * |u|."""
    torch.manual_seed(0)
    weight, bias = nn.Parameter(torch.randn(32) * 10), nn.Parameter(torch.randn(32) * 10)
    optimizer = FusedLAMB([{"params": [weight], "weight_decay": 1e-9}, {"params": [bias], "weight_decay": 0.0}],
                          lr=0.01, max_grad_norm=float("inf"))
    weight.grad, bias.grad = torch.ones(32), torch.ones(32)
    before = weight.detach().clone(), bias.detach().clone()
    optimizer.step()
    # Step 1, bias-corrected: every update element is g / (|g| + eps), about 1.
    torch.testing.assert_close((weight - before[0]).norm(), 0.01 * before[0].norm(), rtol=1e-4, atol=0)
    torch.testing.assert_close((bias - before[1]).abs(), torch.full((32,), 0.01), rtol=0, atol=4e-6)  # ulps of 10


# ---- amp_C and the fallback -----------------------------------------------------------------------


def lamb_lists(form, seed, offset, device="cpu"):
    """Tensors of the dtypes of ``form`` across chunk boundaries, one empty, some one element past
    an aligned address (``offset``)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, CHUNK - 1, CHUNK + 1, 0, 2 * CHUNK + 5, 3]
    lists = []
    for k, dtype in enumerate(form):
        tensors = []
        for size in sizes:
            base = torch.randn(size + offset, generator=gen) * (1024.0 if k == 0 else 0.1 if k > 1 else 1.0)
            if k == 3:
                base = base.abs()
            tensors.append(base.to(device, dtype)[offset:])
        lists.append(tensors)
    return lists


def lamb_call(op, lists, flag, **overrides):
    args = dict(lr=1e-2, beta1=0.9, beta2=0.999, epsilon=1e-6, step=5, bias_correction=1, weight_decay=0.01,
                grad_averaging=1, mode=1, global_grad_norm=3.0, max_grad_norm=1.0, use_nvlamb=False,
                inv_scale=2.0**-10)
    args.update(overrides)
    op(CHUNK, flag, lists, *args.values())


@needs_amp_C
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", _adam_forms(remainders=False), ids=str)
@pytest.mark.parametrize("poison", [None, ("first", float("inf")), ("middle", float("nan")), ("last", -float("inf"))])
@pytest.mark.parametrize("offset", [0, 1])
def test_amp_C_matches_the_fallback_bitwise(device, form, poison, offset):
    device = kernel_device(device)
    ours, theirs = lamb_lists(form, 7, offset, device), lamb_lists(form, 7, offset, device)
    if poison is not None:
        where, value = poison
        for lists in (ours, theirs):
            grad = lists[0][4]
            grad[{"first": 0, "middle": grad.numel() // 2, "last": -1}[where]] = value
    flags = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(2)]
    lamb_call(amp_C.multi_tensor_lamb, ours, flags[0])
    lamb_call(_pytorch_ops.multi_tensor_lamb, theirs, flags[1])
    for a, b in zip(sum(ours, []) + flags[:1], sum(theirs, []) + flags[1:]):
        # An inf grad makes NaN updates (inf / inf), whose payload is not part of the contract.
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@needs_amp_C
@pytest.mark.parametrize("overrides", [
    dict(mode=0), dict(weight_decay=0.0), dict(weight_decay=0.0, use_nvlamb=True), dict(grad_averaging=0),
    dict(bias_correction=0), dict(global_grad_norm=0.5), dict(global_grad_norm=torch.tensor([7.0])),
    dict(inv_scale=torch.tensor([0.5]), max_grad_norm=1e-3), dict(step=2**31 - 1), dict(global_grad_norm=float("nan")),
], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_amp_C_matches_the_fallback_for_every_option(device, overrides):
    device = kernel_device(device)
    overrides = {name: value.to(device) if isinstance(value, torch.Tensor) else value
                 for name, value in overrides.items()}
    form = (torch.float16, torch.float32, torch.float32, torch.float32, torch.bfloat16)
    ours, theirs = lamb_lists(form, 8, 1, device), lamb_lists(form, 8, 1, device)
    lamb_call(amp_C.multi_tensor_lamb, ours, torch.zeros(1, device=device), **overrides)
    lamb_call(_pytorch_ops.multi_tensor_lamb, theirs, torch.zeros(1, device=device), **overrides)
    assert_identical(ours, theirs)


@pytest.mark.parametrize("impl", ["fallback", pytest.param("amp_C", marks=needs_amp_C)])
def test_a_set_flag_writes_nothing(impl):
    op = amp_C.multi_tensor_lamb if impl == "amp_C" else _pytorch_ops.multi_tensor_lamb
    lists = lamb_lists(_adam_forms()[-1], 9, 0)
    before = [[t.clone() for t in tensors] for tensors in lists]
    lamb_call(op, lists, torch.ones(1, dtype=torch.int32))
    assert_identical(lists, before)


def test_the_fallback_never_writes_the_grads():
    lists = lamb_lists((torch.float32,) * 4, 10, 0)
    grads = [t.clone() for t in lists[0]]
    lamb_call(_pytorch_ops.multi_tensor_lamb, lists, torch.zeros(1))
    assert_identical(lists[0], grads)


# ---- the optimizer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(amsgrad=True), "amsgrad"), (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(max_grad_norm=-1.0), "max_grad_norm"), (dict(betas=(1.0, 0.9)), "beta"), (dict(lr=-1.0), "learning rate"),
])
def test_bad_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusedLAMB(Tower().parameters(), **kwargs)


def test_a_step_count_out_of_range_is_refused_before_anything_loads():
    optimizer = FusedLAMB(Tower().parameters())
    state = optimizer.state_dict()
    state["param_groups"][0]["step"] = 2**31
    with pytest.raises(ValueError, match="FusedLAMB.load_state_dict: param group 0 has the step count"):
        optimizer.load_state_dict(state)
    assert "step" not in optimizer.param_groups[0]


def amp_run(opt_level, steps, inject=(), passes=2, materialize=True, model=None, optimizer=None, losses=None):
    """Train ``Net`` with FusedLAMB through amp: ``passes`` backward passes per step (accumulation),
    an inf written into a grad at the (step, pass) pairs of ``inject``."""
    if model is None:
        model = net(0)
        optimizer = FusedLAMB(model.parameters(), lr=0.01, weight_decay=0.01, materialize_master_grads=materialize)
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    losses = [] if losses is None else losses
    for step in steps:
        for micro in range(passes):
            loss = loss_of(model(batch(step * passes + micro)))
            losses.append(loss.item())
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
                if (step, micro) in inject:
                    poison_grad(next(model.parameters()))
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer, losses


@pytest.mark.parametrize("opt_level", ["O2", "O5"])
@pytest.mark.parametrize("materialize", [True, False])
def test_amp_master_weights_train_like_fp32(opt_level, materialize):
    _, _, fp32_losses = amp_run("O0", range(8))
    _, _, losses = amp_run(opt_level, range(8), materialize=materialize)
    tolerance = dict(rtol=2e-2, atol=2e-3) if opt_level == "O2" else dict(rtol=8e-2, atol=2e-2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(fp32_losses), **tolerance)


@pytest.mark.parametrize("materialize", [True, False])
def test_a_skipped_step_changes_nothing_and_is_not_counted(materialize):
    model, optimizer, _ = amp_run("O2", range(2), materialize=materialize)

    def stepped():  # what a step changes (the forward passes update batch norm's statistics)
        return copy.deepcopy(([p.detach() for p in model.parameters()], optimizer.state_dict(),
                              [m.detach() for m in amp.master_params(optimizer)]))
    before = stepped()
    amp_run("O2", [2], inject={(2, 1)}, model=model, optimizer=optimizer)
    after = stepped()
    assert_identical(after, before)
    assert optimizer.param_groups[0]["step"] == 2 and int(amp.skipped_steps(optimizer)) == 1


def test_an_o2_bert_style_run_resumes_bit_exactly():
    """Apex's checkpoint recipe at O2 with FusedLAMB, an overflow and accumulation on the way: the
    resumed run equals the uninterrupted one, losses, weights and masters."""
    inject = {(1, 0), (4, 1)}
    model, optimizer, losses = amp_run("O2", range(8), inject=inject)
    expected = dict(losses=losses, model=model.state_dict(), masters=list(amp.master_params(optimizer)))

    model, optimizer, first = amp_run("O2", range(3), inject=inject)
    buffer = io.BytesIO()
    torch.save(dict(model=model.state_dict(), optimizer=optimizer.state_dict(), amp=amp.state_dict()), buffer)
    del model, optimizer
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model = net(1)  # other initial weights: everything must come from the checkpoint
    optimizer = FusedLAMB(model.parameters(), lr=0.01, weight_decay=0.01)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    amp.load_state_dict(saved["amp"])
    model, optimizer, rest = amp_run("O2", range(3, 8), inject=inject, model=model, optimizer=optimizer)
    assert_identical(dict(losses=first + rest, model=model.state_dict(), masters=list(amp.master_params(optimizer))),
                     expected)
