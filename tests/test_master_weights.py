"""fp32 master weights for every floating param, whether or not it requires grad when the masters
are made, checked against plain fp32 PyTorch trained on the same data with the same freeze schedule."""
import copy
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

import amp
from amp_common import LOW_DTYPE, MASTER_LEVELS, TOLERANCES, batch, loss_of, net
from fp16_utils import DeprecatedFeatureWarning, FP16_Optimizer, convert_network

FROZEN_STEPS = UNFROZEN_STEPS = 3
# Small enough that an update stepped directly on a bf16 param is mostly rounded away.
LR = 1e-3


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


UNFROZEN = ("fc2", "bn")  # fc2 is low precision under O2/O5, bn is kept in fp32


def set_frozen(model, frozen):
    for name in UNFROZEN:
        getattr(model, name).requires_grad_(not frozen)


def train_fp32_reference(model, steps):
    """Plain fp32 PyTorch: the values the masters should track, after the frozen phase and at the end."""
    model = copy.deepcopy(model)
    optimizer = sgd(model.parameters())
    snapshots = []
    for phase, frozen in enumerate((True, False)):
        set_frozen(model, frozen)
        for step in steps[phase]:
            optimizer.zero_grad()
            loss_of(model(batch(step))).backward()
            optimizer.step()
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return snapshots


def train_and_snapshot(model, masters, steps, train_step):
    snapshots = []
    for phase, frozen in enumerate((True, False)):
        set_frozen(model, frozen)
        for step in steps[phase]:
            train_step(step)
        snapshots.append([m.detach().float().clone() for m in masters()])
    return snapshots


def assert_tracks_fp32_reference(snapshots, reference, model, dtype):
    """Each unfrozen master's update matches the fp32 one within the error of low-precision grads
    (under 10%; a scaled update would be 2**16 times too large, one stepped in bf16 would be mostly
    lost), and the final params match within tolerance."""
    (at_unfreeze, final), (ref_at_unfreeze, ref_final) = snapshots, reference
    names = [name for name, _ in model.named_parameters()]
    for name, start, end, ref_start, ref_end in zip(names, at_unfreeze, final, ref_at_unfreeze, ref_final):
        if name.split(".")[0] in UNFROZEN:
            update, ref_update = end - start, ref_end - ref_start
            error = (update - ref_update).norm() / ref_update.norm()
            assert error < 0.25, f"{name}: update is off by {error:.3g} of the fp32 reference's"
    for param, ref in zip(model.parameters(), ref_final):
        torch.testing.assert_close(param.float(), ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("opt_level", MASTER_LEVELS)
def test_amp_param_frozen_at_initialize_trains_like_fp32_once_unfrozen(opt_level):
    model = net()
    set_frozen(model, True)
    steps = (range(FROZEN_STEPS), range(FROZEN_STEPS, FROZEN_STEPS + UNFROZEN_STEPS))
    reference = train_fp32_reference(model, steps)
    optimizer = sgd(model.parameters())
    # The levels' own scales: dynamic from 2**16 under O2, 1 under O5.
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)

    def train_step(step):
        optimizer.zero_grad()
        with amp.scale_loss(loss_of(model(batch(step))), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()

    snapshots = train_and_snapshot(model, lambda: amp.master_params(optimizer), steps, train_step)
    assert_tracks_fp32_reference(snapshots, reference, model, LOW_DTYPE[opt_level])


@pytest.mark.parametrize("dtype, loss_scale", [(torch.float16, 2.0**16), (torch.bfloat16, 1.0)])
def test_FP16_Optimizer_param_frozen_at_construction_trains_like_fp32_once_unfrozen(dtype, loss_scale):
    model = net()
    set_frozen(model, True)
    steps = (range(FROZEN_STEPS), range(FROZEN_STEPS, FROZEN_STEPS + UNFROZEN_STEPS))
    reference = train_fp32_reference(model, steps)
    convert_network(model, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecatedFeatureWarning)
        optimizer = FP16_Optimizer(sgd(model.parameters()), static_loss_scale=loss_scale, verbose=False)

    def train_step(step):
        optimizer.zero_grad()
        optimizer.backward(loss_of(model(batch(step).to(dtype))))
        optimizer.step()

    masters = lambda: [p for group in optimizer.param_groups for p in group["params"]]  # noqa: E731
    snapshots = train_and_snapshot(model, masters, steps, train_step)
    assert_tracks_fp32_reference(snapshots, reference, model, dtype)


# ---------------------------------------------------------------- one-way dependency

def run_python(code):
    """Run ``code`` in a fresh interpreter (so nothing is imported yet) from the repository root."""
    root = pathlib.Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.slow
def test_importing_amp_does_not_import_fp16_utils():
    code = ("import sys, torch, amp\n"
            "model, opt = amp.initialize(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2)"
            ".parameters(), lr=0.1), opt_level='O2', verbosity=0)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'fp16_utils'))")
    assert run_python(code).strip() == "[]"


@pytest.mark.slow
def test_importing_fp16_utils_first_works_and_shares_amps_helpers():
    code = ("import fp16_utils, amp, amp._master_weights as mw, fp16_utils.fp16util as util\n"
            "assert fp16_utils.convert_network is mw.convert_network\n"
            "assert util.swap_in_fp32_masters is mw.swap_in_fp32_masters\n"
            "assert util.check_param_dtypes is mw.check_param_dtypes\n"
            "for name in fp16_utils.__all__: getattr(fp16_utils, name)\n"
            "print('ok')")
    assert run_python(code).strip() == "ok"


def test_amp_initialize_refuses_an_FP16_Optimizer():
    model = net().half()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecatedFeatureWarning)
        optimizer = FP16_Optimizer(sgd(model.parameters()), verbose=False)
    for optimizers in ([optimizer], optimizer):
        with pytest.raises(RuntimeError, match="is an instance of fp16_utils.FP16_Optimizer"):
            amp.initialize(model.float(), optimizers, opt_level="O2", verbosity=0)
