"""Models, data and checks shared by the tests of amp.initialize, scale_loss and step (imported, not collected).

References are plain PyTorch on the same data. Two facts make most comparisons exact: with
``cast_model_type=False`` (or O0) the model stays fp32, and multiplying by a power-of-two loss
scale and by its inverse is exact in fp32, so a dynamically scaled fp32 run equals an unscaled
fp32 run bit for bit. Where a level rounds the model itself (O1-O5), the tests say what they
compare and with which tolerance.
"""
import contextlib
import copy
import functools
import importlib.util
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import amp
from amp import _pytorch_ops
from amp.frontend import OPT_LEVELS

REPO = Path(__file__).resolve().parents[1]


def load_script(relative_path):
    """A file of the repository outside the packages (examples/, tools/, benchmarks/) as a module."""
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def has_fused(optimizer_class, device="cpu"):
    """Whether this torch steps ``optimizer_class(fused=True)`` on ``device`` (CPU: torch >= 2.4)."""
    param = torch.zeros(1, device=device, requires_grad=True)
    param.grad = torch.ones_like(param)
    try:
        optimizer_class([param], lr=0.1, fused=True).step()
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


def needs_fused(*optimizer_classes, device="cpu"):
    """Skip mark for a test of fused optimizers on a torch that has not got them on ``device``."""
    missing = [cls.__name__ for cls in optimizer_classes if not has_fused(cls, device)]
    return pytest.mark.skipif(bool(missing), reason=f"torch {torch.__version__} has no fused "
                              f"{', '.join(missing)} on {device}")


@contextlib.contextmanager
def correctly_rounded_sqrt():
    """Within the block, ``Tensor.sqrt`` of fp32 is correctly rounded (fp64's root rounded once).

    torch's CPU ``sqrt`` (MKL's) is not, on every CPU build: about one fp32 root in six is an ulp
    off, and which ones depends on the CPU's instruction set. amp's kernels round correctly, as
    CUDA's does, so torch.optim's Adam stepped inside this block is their bit-exact reference.
    """
    own = vars(torch.Tensor).get("sqrt")
    original = torch.Tensor.sqrt

    def sqrt(self):
        return original(self.double()).float() if self.dtype == torch.float32 else original(self)
    torch.Tensor.sqrt = sqrt
    try:
        yield
    finally:
        if own is None:
            del torch.Tensor.sqrt
        else:
            torch.Tensor.sqrt = own


def with_correctly_rounded_sqrt(optimizer_class):
    """A subclass of ``optimizer_class`` whose ``step`` runs inside :func:`correctly_rounded_sqrt`."""
    class Reference(optimizer_class):
        def step(self, closure=None):
            with correctly_rounded_sqrt():
                return super().step(closure)
    Reference.__name__ = Reference.__qualname__ = optimizer_class.__name__
    return Reference


# From amp's opt-level table; tests/test_initialize.py pins the table itself to Apex's presets.
LEVELS = list(OPT_LEVELS)
# The dtype each level trains in: the one O1/O4 patch to, else the one the model is cast to.
LOW_DTYPE = {name: level.patch_type or level.options["cast_model_type"]
             for name, level in OPT_LEVELS.items()}
MASTER_LEVELS = ("O2", "O5")
# Tolerance of one low-precision rounding of weights, activations and grads against fp32.
TOLERANCES = {torch.float16: dict(rtol=2e-2, atol=2e-3), torch.bfloat16: dict(rtol=8e-2, atol=2e-2)}


class Net(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Linear: one affine BN to keep fp32 under O2/O5."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def net(seed=0):
    torch.manual_seed(seed)
    return Net()


def batch(step, rows=16):
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, 4, generator=generator)


def loss_of(output):
    return output.float().pow(2).mean()


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    # eps=1e-8 is 0 in fp16, and pure-fp16 (O3) Adam then divides 0 by 0.
    return torch.optim.Adam(params, lr=0.01, eps=1e-4)


def initialized(opt_level, make_optimizer=sgd, seed=0, **kwargs):
    """A fresh ``Net`` and optimizer through ``amp.initialize`` (silent)."""
    model = net(seed)
    optimizer = make_optimizer(model.parameters())
    kwargs.setdefault("verbosity", 0)
    return amp.initialize(model, optimizer, opt_level=opt_level, **kwargs)


def named_masters(model, optimizer):
    """``{name: master}``; an fp32 param (BN) is its own master. The optimizer lists the params in model order."""
    return {name: master for (name, _), master in zip(model.named_parameters(), amp.master_params(optimizer))}


def poison_grad(tensor, value=float("inf")):
    """Write a non-finite value into ``tensor.grad`` as a buggy model would."""
    with torch.no_grad():
        tensor.grad.view(-1)[0] = value


def train_step(model, optimizer, step, inject=False, loss_id=0):
    """One iteration of Apex's three-line recipe; ``inject`` poisons a grad inside the block."""
    loss = loss_of(model(batch(step)))
    with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled_loss:
        scaled_loss.backward()
        if inject:
            poison_grad(next(model.parameters()))
    optimizer.step()
    optimizer.zero_grad()
    return loss


def snapshot(model, optimizer):
    """Deep copies of everything a step may change: model, masters, optimizer state."""
    return dict(model=copy.deepcopy(model.state_dict(keep_vars=False)),
                params=[p.detach().clone() for p in model.parameters()],
                masters=[p.detach().clone() for p in amp.master_params(optimizer)],
                optimizer=copy.deepcopy(optimizer.state_dict()))


def assert_identical(actual, expected, path="value"):
    """Recursive bit-for-bit equality (dtype included) of tensors inside dicts, lists and numbers."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype, f"{path}: {actual.dtype} != {expected.dtype}"
        assert torch.equal(actual, expected), f"{path} differs"
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), path
        for key in expected:
            assert_identical(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_identical(a, e, f"{path}[{index}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


# ---- amp_C stand-ins: the PyTorch ops, some made wrong on purpose --------------------------------


def stand_in_amp_C(**wrong):
    """A module in place of amp_C: the fallback's ops, but ``wrong[name]`` for those named."""
    ops = {name: getattr(_pytorch_ops, name) for name in _pytorch_ops.__all__}
    return types.SimpleNamespace(cuda_available=lambda: False, **{**ops, **wrong})


def flip_one_bit(op, argument=2, index=-1, bit=0):
    """``op``, then one bit (the lowest by default) flipped in a middle element of
    ``args[argument][index]`` (a list's middle tensor)."""
    def wrong(*args):
        returned = op(*args)
        target = args[argument] if index is None else args[argument][index]
        tensors = [t for t in (target if isinstance(target, list) else [target]) if t.numel() > 0]
        if tensors:
            t = tensors[len(tensors) // 2].view(-1)
            bits = t.view({2: torch.int16, 4: torch.int32}[t.element_size()])
            bits[bits.numel() // 2] ^= 1 << bit
        return returned
    return wrong


def ignore_the_flag(op):
    """``op`` on a private flag: it neither raises the caller's flag nor obeys a set one."""
    def wrong(chunk_size, noop_flag, *args):
        return op(chunk_size, torch.zeros_like(noop_flag), *args)
    return wrong
