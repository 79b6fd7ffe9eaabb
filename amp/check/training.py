"""Whole training steps through amp on one device: the path amp takes there against PyTorch's.

The kernel self-tests prove each op alone; these prove that amp calls them right. Each check
trains a small model (Linear, BatchNorm, ReLU, Linear) for three steps, the second with an inf
written into a gradient inside the ``scale_loss`` block, twice: once as amp runs on the device
(``amp_C`` where it serves, see the environment report) and once with
``use_extension(False)`` (the pure-PyTorch fallback). Both must end with the same bits in every
parameter, master weight, optimizer state tensor and loss scale, and must have skipped exactly
the poisoned step. A plain fp32 PyTorch run of the same two applied steps is the sanity
reference, within the tolerance of fp16 rounding.

amp's runs are process-wide state (O1 patches torch functions), so these checks run only in a
process where amp has not been initialized yet, and leave it as they found it.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F

import amp
from amp import _pytorch_ops
from amp._amp_state import AmpState, _amp_state
from amp.multi_tensor_apply import path_for, use_extension

from .report import FAIL, PASS, SKIP, Result, error_line

__all__ = ["CHECKS", "checks", "training_check", "amp_in_use"]

STEPS, POISONED_STEP = 3, 1
# fp16 rounding of weights, activations and grads against fp32, after two applied steps. Adam's
# step is about lr * sign(grad), so a tiny gradient whose sign fp16 flips moves a weight by 2 lr.
RTOL, ATOL_SGD, ATOL_ADAM = 2e-2, 2e-3, 5e-3

MakeOptimizer = Callable[[List[nn.Parameter]], torch.optim.Optimizer]


def _sgd(params: List[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _fused_adam(params: List[nn.Parameter]) -> torch.optim.Optimizer:
    # The kernel that reads the model's fp16 grads and unscales them itself; FusedSGD's check covers
    # the one that reads fp32 master grads (both optimizers' default).
    return amp.optimizers.FusedAdam(params, lr=1e-3, weight_decay=1e-2, materialize_master_grads=False)


def _adamw(params: List[nn.Parameter]) -> torch.optim.Optimizer:
    # FusedAdam's default is AdamW (adam_w_mode=True), as Apex's.
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2)


def _fused_sgd(params: List[nn.Parameter]) -> torch.optim.Optimizer:
    return amp.optimizers.FusedSGD(params, lr=0.1, momentum=0.9)


# name -> (opt level, the optimizer amp steps, the torch.optim one for the fp32 reference, its
# absolute tolerance)
CHECKS: Dict[str, Tuple[str, MakeOptimizer, MakeOptimizer, float]] = {
    "O1 step": ("O1", _sgd, _sgd, ATOL_SGD),
    "O2 step": ("O2", _sgd, _sgd, ATOL_SGD),
    "O2 step, FusedAdam": ("O2", _fused_adam, _adamw, ATOL_ADAM),
    "O2 step, FusedSGD": ("O2", _fused_sgd, _sgd, ATOL_SGD),
}


def checks(quick: bool) -> List[str]:
    """The checks a run makes: ``--quick`` leaves out FusedSGD (FusedAdam covers the fused path)."""
    return [name for name in CHECKS if not (quick and name == "O2 step, FusedSGD")]


def amp_in_use() -> bool:
    """Whether this process has run ``amp.initialize`` (the checks must not disturb its runs)."""
    return _amp_state.context is not None or _amp_state.handle is not None


@contextlib.contextmanager
def _private_runs() -> Iterator[None]:
    """Undo what the checks' ``amp.initialize`` calls left behind, in a process that had none."""
    try:
        yield
    finally:
        amp.deactivate()
        vars(_amp_state).update(vars(AmpState()))  # back to a fresh process's state


def _model(device: torch.device) -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 160), nn.BatchNorm1d(160), nn.ReLU(), nn.Linear(160, 10))
    with torch.no_grad():
        for name, p in model.named_parameters():
            values = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(values + 1.0 if name == "1.weight" else values)  # BatchNorm's scale near 1
    return model.to(device)


def _batch(step: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(64, 32, generator=gen).to(device),
            torch.randint(0, 10, (64,), generator=gen).to(device))


def _state(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [value for state in optimizer.state_dict()["state"].values()
            for value in state.values() if isinstance(value, torch.Tensor)]


def _amp_run(opt_level: str, make_optimizer: MakeOptimizer, device: torch.device,
             fallback: bool) -> Dict[str, List[torch.Tensor]]:
    """Three steps through amp, the second poisoned; everything the steps changed."""
    model = _model(device)
    optimizer = make_optimizer(list(model.parameters()))
    with use_extension(False) if fallback else contextlib.nullcontext():
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
        for step in range(STEPS):
            x, y = _batch(step, device)
            loss = F.cross_entropy(model(x).float(), y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
                if step == POISONED_STEP:
                    grad = next(model.parameters()).grad
                    assert grad is not None  # the backward just set it
                    with torch.no_grad():
                        grad.view(-1)[-1] = float("inf")
            optimizer.step()
            optimizer.zero_grad()
        return {
            "model parameter": [p.detach().clone() for p in model.parameters()],
            "master weight": [p.detach().clone() for p in amp.master_params(optimizer)],
            "optimizer state": [t.clone() for t in _state(optimizer)],
            "loss scale": [amp.loss_scale_tensor(optimizer=optimizer).detach().clone().reshape(1)],
            "skipped steps": [amp.skipped_steps(optimizer).detach().clone().reshape(1)],
        }


def _reference(make_optimizer: MakeOptimizer, device: torch.device) -> List[torch.Tensor]:
    """The fp32 weights after the applied steps, in plain PyTorch."""
    model = _model(device)
    optimizer = make_optimizer(list(model.parameters()))
    for step in range(STEPS):
        x, y = _batch(step, device)
        F.cross_entropy(model(x), y).backward()
        if step != POISONED_STEP:
            optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])


Snapshot = Dict[str, List[torch.Tensor]]


def _first_difference(ours: Snapshot, theirs: Snapshot) -> Optional[str]:
    for what, tensors in ours.items():
        if len(tensors) != len(theirs[what]):
            return f"{len(tensors)} {what}s with amp's path, {len(theirs[what])} with PyTorch's"
        for i, (a, b) in enumerate(zip(tensors, theirs[what])):
            if not _same_bits(a, b):
                return f"{what} {i} differs between amp's path and PyTorch's"
    return None


def training_check(name: str, device: torch.device) -> Result:
    """Run the training check ``name`` (a key of ``CHECKS``) on ``device``."""
    start = time.perf_counter()
    if amp_in_use():
        return Result(name, str(device), SKIP, "amp.initialize already ran in this process; run "
                      "`python -m amp.check` in a fresh one for the training steps")
    opt_level, amp_optimizer, torch_optimizer, atol = CHECKS[name]
    # Where amp_C serves no op, amp's path is PyTorch's: one run, held to the fp32 reference.
    uses_amp_C = any(path_for(op, device)[0] == "amp_C" for op in _pytorch_ops.__all__)
    try:
        with _private_runs():
            ours = _amp_run(opt_level, amp_optimizer, device, fallback=False)
            theirs = _amp_run(opt_level, amp_optimizer, device, fallback=True) if uses_amp_C else ours
        reference = _reference(torch_optimizer, device)
    except Exception as err:  # noqa: BLE001 - any error is the finding, named in the report
        return Result(name, str(device), FAIL, f"raised {error_line(err)}", 1,
                      time.perf_counter() - start)
    seconds = time.perf_counter() - start
    problem = _first_difference(ours, theirs)
    skipped = int(ours["skipped steps"][0].item())
    if problem is None and skipped != 1:
        problem = f"{skipped} steps skipped, expected exactly the poisoned one"
    if problem is None:
        weights = ours["master weight"]
        for i, (w, r) in enumerate(zip(weights, reference)):
            if not torch.allclose(w.float(), r, rtol=RTOL, atol=atol):
                error = (w.float() - r).abs().max().item()
                problem = (f"master weight {i} is {error:.3g} away from plain fp32 PyTorch's "
                           f"(beyond rtol {RTOL}, atol {atol})")
                break
    if problem is not None:
        return Result(name, str(device), FAIL, problem, 1, seconds)
    paths = ("amp's path (amp_C) equals PyTorch's bit for bit" if uses_amp_C
             else "amp_C is not used here, so amp's path is PyTorch's")
    return Result(name, str(device), PASS, f"{STEPS} steps, one overflow skipped; {paths}; within fp16 "
                  "rounding of plain fp32 PyTorch", 1, seconds)
