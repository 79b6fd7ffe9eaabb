"""Check before trusting: amp tests ``amp_C`` on each device before it uses it there (issue 27).

A wrong kernel is made on purpose, as in ``tests/test_check.py``: a stand-in ``amp_C`` whose ops
are the PyTorch fallback's, one of them made one bit off, blind to the flag, or raising. Training
through amp must then equal the pure PyTorch path bit for bit, with exactly one ERROR.
"""
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import amp
import amp.multi_tensor_apply as mta
from amp import _pytorch_ops
from amp.check import first_use
from amp.check.report import FAIL, PASS
from amp.multi_tensor_apply import use_extension, use_self_test
from amp_common import (assert_identical, flip_one_bit, ignore_the_flag, initialized, poison_grad, snapshot,
                        stand_in_amp_C, train_step)

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[1]


def off_by_one_bit(op):
    """A norm op whose total norm is one bit off."""
    def wrong(*args):
        total, per_tensor = op(*args)
        total.view(torch.int32).add_(1)
        return total, per_tensor
    return wrong


def launch_fails(*args):
    raise RuntimeError("CUDA error: no kernel image is available for execution on the device")


WRONG = {
    "multi_tensor_scale": [flip_one_bit(_pytorch_ops.multi_tensor_scale), ignore_the_flag(_pytorch_ops.multi_tensor_scale)],
    "multi_tensor_axpby": [flip_one_bit(_pytorch_ops.multi_tensor_axpby), ignore_the_flag(_pytorch_ops.multi_tensor_axpby)],
    "multi_tensor_l2norm": [off_by_one_bit(_pytorch_ops.multi_tensor_l2norm),
                            ignore_the_flag(_pytorch_ops.multi_tensor_l2norm)],
    "multi_tensor_l2norm_mp": [off_by_one_bit(_pytorch_ops.multi_tensor_l2norm_mp),
                               ignore_the_flag(_pytorch_ops.multi_tensor_l2norm_mp)],
    "multi_tensor_unscale_l2norm": [off_by_one_bit(_pytorch_ops.multi_tensor_unscale_l2norm),
                                    ignore_the_flag(_pytorch_ops.multi_tensor_unscale_l2norm)],
    "update_scale_hysteresis": [flip_one_bit(_pytorch_ops.update_scale_hysteresis, argument=0, index=None)],
    "multi_tensor_sgd": [flip_one_bit(_pytorch_ops.multi_tensor_sgd, index=1),
                         ignore_the_flag(_pytorch_ops.multi_tensor_sgd)],
    "multi_tensor_adam": [flip_one_bit(_pytorch_ops.multi_tensor_adam, index=3),
                          ignore_the_flag(_pytorch_ops.multi_tensor_adam), launch_fails],
}


@pytest.fixture
def fresh(monkeypatch, caplog):
    """A process in which amp has tested no device yet; ``install(**wrong)`` puts a stand-in amp_C in."""
    monkeypatch.setattr(mta, "_self_test_passed", set())
    monkeypatch.setattr(mta, "_self_test_failures", {})
    monkeypatch.setattr(mta, "_self_test_enabled", True)
    caplog.set_level(logging.INFO, logger="amp")

    def install(**wrong):
        monkeypatch.setattr(mta, "amp_C", stand_in_amp_C(**wrong))
    with use_extension(True):
        yield install


def errors(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "amp" and r.levelno >= logging.ERROR]


# ---- the test itself -------------------------------------------------------------------------------


def test_the_fallback_s_own_ops_pass():
    result = first_use.self_test(stand_in_amp_C(), CPU)
    assert (result.check, result.device, result.status) == (first_use.CHECK, "cpu", PASS), result.detail
    assert result.cases > 50


@pytest.mark.skipif(mta.amp_C is None, reason="amp_C is not built")
def test_this_build_of_amp_C_passes_on_this_cpu():
    result = first_use.self_test(mta.amp_C, CPU)
    assert result.status == PASS, result.detail


@pytest.mark.parametrize("op, wrong", [(op, wrong) for op, ways in WRONG.items() for wrong in ways],
                         ids=lambda v: v if isinstance(v, str) else v.__qualname__.split(".")[0])
def test_each_wrong_kernel_fails_it_naming_the_op_and_the_first_difference(op, wrong):
    result = first_use.self_test(stand_in_amp_C(**{op: wrong}), CPU)
    assert result.status == FAIL and result.detail.startswith(f"{op}: ")
    assert "with amp_C but" in result.detail or "amp_C raised RuntimeError: CUDA error" in result.detail


def test_an_error_without_a_message_is_named_by_its_type():
    def bare(*args):
        raise RuntimeError()
    result = first_use.self_test(stand_in_amp_C(multi_tensor_scale=bare), CPU)
    assert result.status == FAIL and result.detail.endswith(": amp_C raised RuntimeError")


def test_every_op_has_cases():
    for op in _pytorch_ops.__all__:
        assert list(first_use.first_use_cases(op, CPU)), op


def test_it_leaves_the_random_state_and_the_default_dtype_alone():
    rng = torch.get_rng_state()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the cases name every dtype they need
    try:
        result = first_use.self_test(stand_in_amp_C(), CPU)
    finally:
        torch.set_default_dtype(previous)
    assert result.status == PASS, result.detail
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_default_device_does_not_fail_it():
    with torch.device("meta"):
        result = first_use.self_test(stand_in_amp_C(), CPU)
    assert result.status == PASS, result.detail


# ---- amp with a wrong kernel: the PyTorch path, bit for bit, and one ERROR ---------------------------


def train(opt_level, make_optimizer, steps=4, **kwargs):
    model, optimizer = initialized(opt_level, make_optimizer, **kwargs)
    for step in range(steps):
        train_step(model, optimizer, step, inject=step == 2)
    return snapshot(model, optimizer)


def fused_adam(params):
    return amp.optimizers.FusedAdam(params, lr=1e-2)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


STAND_INS = {
    "a result one bit off": ("multi_tensor_scale", flip_one_bit(_pytorch_ops.multi_tensor_scale, bit=20), sgd),
    "a flag never raised": ("multi_tensor_scale", ignore_the_flag(_pytorch_ops.multi_tensor_scale), sgd),
    "a launch that raises": ("multi_tensor_adam", launch_fails, fused_adam),
}


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("kind", STAND_INS)
def test_training_equals_the_pytorch_path_bit_for_bit_with_one_error(fresh, caplog, kind, opt_level):
    op, wrong, make_optimizer = STAND_INS[kind]
    with use_extension(False):
        expected = train(opt_level, make_optimizer)
    fresh(**{op: wrong})
    actual = train(opt_level, make_optimizer)
    assert_identical(actual, expected)
    (error,) = errors(caplog)
    assert error.startswith(f"amp: amp_C failed amp's first-use self-test on cpu: {op}: ")
    assert ("with amp_C but" in error) != (kind == "a launch that raises")
    assert "python -m amp.check" in error and "PyTorch multi-tensor ops on cpu" in error
    assert mta.path_for(op, CPU)[0] == "torch"


@pytest.mark.parametrize("kind", STAND_INS)
def test_without_the_self_test_the_wrong_kernels_would_change_training(fresh, kind):
    op, wrong, make_optimizer = STAND_INS[kind]
    with use_extension(False):
        expected = train("O2", make_optimizer)
    fresh(**{op: wrong})
    with use_self_test(False):
        if kind == "a launch that raises":
            with pytest.raises(RuntimeError, match="no kernel image"):
                train("O2", make_optimizer)
            return
        actual = train("O2", make_optimizer)
    with pytest.raises(AssertionError):
        assert_identical(actual, expected)


def test_a_device_that_passes_keeps_amp_C(fresh, caplog):
    calls = []

    def counted(*args):
        calls.append(args)
        return _pytorch_ops.multi_tensor_scale(*args)
    fresh(multi_tensor_scale=counted)
    model, optimizer = initialized("O2", sgd)
    tested = len(calls)
    train_step(model, optimizer, 0)
    assert "cpu" in mta._self_test_passed and tested > 0 and len(calls) > tested
    assert errors(caplog) == []


def test_initialize_runs_it_for_the_models_devices_before_any_step(fresh, caplog):
    fresh(multi_tensor_axpby=flip_one_bit(_pytorch_ops.multi_tensor_axpby))
    initialized("O2", sgd)
    assert len(errors(caplog)) == 1 and "multi_tensor_axpby" in errors(caplog)[0]
    path, reason = mta.path_for("multi_tensor_axpby", CPU)
    assert path == "torch" and reason.startswith("amp_C failed amp's first-use self-test on cpu (multi_tensor_axpby: ")


def unscale(out):
    grads = [torch.full((5,), 3.0, dtype=torch.float16), torch.full((700,), -1.5, dtype=torch.float16)]
    flag = torch.zeros(1, dtype=torch.int32)
    mta.multi_tensor_applier(mta.multi_tensor_scale, flag, [grads, out], 0.5)
    return out


def fallback_unscale():
    with use_extension(False):
        return unscale([torch.empty(5), torch.empty(700)])


def test_it_never_runs_while_compiling(fresh, caplog, monkeypatch):
    fresh(multi_tensor_scale=flip_one_bit(_pytorch_ops.multi_tensor_scale))
    monkeypatch.setattr(mta, "is_compiling", lambda: True)
    assert_identical(unscale([torch.empty(5), torch.empty(700)]), fallback_unscale())
    assert (mta._self_test_passed, mta._self_test_failures, errors(caplog)) == (set(), {}, [])
    monkeypatch.setattr(mta, "is_compiling", lambda: False)
    assert_identical(unscale([torch.empty(5), torch.empty(700)]), fallback_unscale())  # tested now
    assert len(errors(caplog)) == 1


def test_a_compiled_call_gets_the_pytorch_path_s_bits(fresh, caplog):
    fresh(multi_tensor_scale=flip_one_bit(_pytorch_ops.multi_tensor_scale))
    compiled = torch.compile(unscale, backend="eager")
    assert_identical(compiled([torch.empty(5), torch.empty(700)]), fallback_unscale())
    assert len(errors(caplog)) <= 1  # wherever dynamo let it run eagerly


class PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_it_waits_while_a_dispatch_mode_is_active(fresh, caplog):
    fresh(multi_tensor_scale=flip_one_bit(_pytorch_ops.multi_tensor_scale))
    with PassThrough():
        out = unscale([torch.empty(5), torch.empty(700)])
    assert_identical(out, fallback_unscale())
    assert mta._self_test_failures == {} and errors(caplog) == []
    unscale([torch.empty(5), torch.empty(700)])
    assert "cpu" in mta._self_test_failures and len(errors(caplog)) == 1


def test_two_threads_reaching_an_untested_device_test_it_once(fresh, caplog, monkeypatch):
    fresh(multi_tensor_scale=flip_one_bit(_pytorch_ops.multi_tensor_scale))
    runs = []
    original = first_use.self_test

    def slow_test(kernels, device):
        runs.append(threading.get_ident())
        time.sleep(0.2)  # so that the other thread arrives while this one tests
        return original(kernels, device)
    monkeypatch.setattr(first_use, "self_test", slow_test)
    barrier, outputs = threading.Barrier(2), {}

    def worker(name):
        barrier.wait()
        outputs[name] = unscale([torch.empty(5), torch.empty(700)])
    threads = [threading.Thread(target=worker, args=(name,)) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(runs) == 1 and len(errors(caplog)) == 1
    expected = fallback_unscale()
    assert_identical(outputs["a"], expected)
    assert_identical(outputs["b"], expected)


def test_the_test_s_own_calls_do_not_come_back_to_it(fresh, caplog):
    def through_amp(chunk_size, flag, lists, scale):
        # A kernel that calls amp's dispatcher: while the device is being tested, PyTorch's op.
        mta.multi_tensor_l2norm(chunk_size, torch.zeros_like(flag), lists[:1])
        return _pytorch_ops.multi_tensor_scale(chunk_size, flag, lists, scale)
    fresh(multi_tensor_scale=through_amp)
    outputs = []
    thread = threading.Thread(target=lambda: outputs.append(unscale([torch.empty(5), torch.empty(700)])),
                              daemon=True)  # a deadlock fails the test instead of hanging it
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive() and len(outputs) == 1
    assert_identical(outputs[0], fallback_unscale())
    assert "cpu" in mta._self_test_passed and errors(caplog) == []


def test_use_self_test_false_trusts_amp_C_as_built(fresh, caplog):
    fresh(multi_tensor_scale=flip_one_bit(_pytorch_ops.multi_tensor_scale))
    with use_self_test(False):
        out = unscale([torch.empty(5), torch.empty(700)])
    with pytest.raises(AssertionError):
        assert_identical(out, fallback_unscale())
    assert errors(caplog) == [] and mta._self_test_failures == {}


SWITCHED_OFF = """
import logging, torch
logging.basicConfig(level=logging.INFO)
import amp.multi_tensor_apply as mta
from amp_common import flip_one_bit, stand_in_amp_C
from amp import _pytorch_ops
mta.amp_C = stand_in_amp_C(multi_tensor_scale=flip_one_bit(_pytorch_ops.multi_tensor_scale))
out = [torch.zeros(700)]
mta.multi_tensor_scale(512, torch.zeros(1, dtype=torch.int32), [[torch.ones(700)], out], 2.0)
print("wrong" if (out[0] != 2.0).any() else "right")
"""


@pytest.mark.slow
@pytest.mark.parametrize("env, outcome", [({"AMP_DISABLE_SELF_TEST": "1"}, "wrong"), ({}, "right")])
def test_AMP_DISABLE_SELF_TEST_turns_it_off(env, outcome):
    environ = {key: value for key, value in os.environ.items() if not key.startswith("AMP_")}
    environ.update(env, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    result = subprocess.run([sys.executable, "-c", SWITCHED_OFF], env=environ, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [outcome]
    assert ("ERROR:amp:amp: amp_C failed" in result.stderr) == (outcome == "right")


def test_the_error_is_not_repeated_across_steps_and_ops(fresh, caplog):
    fresh(multi_tensor_scale=ignore_the_flag(_pytorch_ops.multi_tensor_scale),
          multi_tensor_axpby=flip_one_bit(_pytorch_ops.multi_tensor_axpby))
    model, optimizer = initialized("O2", sgd)
    for step in range(3):
        with amp.scale_loss(model(torch.ones(4, 4)).float().sum(), optimizer) as scaled_loss:
            scaled_loss.backward()
            poison_grad(next(model.parameters()))
        optimizer.step()
    assert len(errors(caplog)) == 1 and amp.skipped_steps(optimizer).item() == 3


# ---- a GPU the build has no code for (issue 27 item 2) ------------------------------------------------


@pytest.mark.parametrize("images, capability, archs", [
    (["sm_80", "sm_90", "compute_90"], (7, 0), "7.0;8.0;9.0+PTX"),
    (["sm_80", "sm_86"], (7, 5), "7.5;8.0;8.6+PTX"),
    (["sm_90a"], (10, 0), "9.0a;10.0+PTX"),
    (["sm_100f", "compute_120"], (12, 1), "10.0f;12.0;12.1+PTX"),
    ([], (8, 6), "8.6+PTX"),
])
def test_the_arch_list_to_rebuild_with_keeps_the_build_s_and_adds_the_gpu(images, capability, archs):
    assert mta.rebuild_arch_list(images, capability) == archs


def test_a_gpu_without_code_in_the_build_is_one_warning_with_the_arch_list(monkeypatch, caplog):
    fake = stand_in_amp_C()
    fake.build_info = lambda: {"cuda_kernels": True, "cuda_images": ["sm_80", "sm_90", "compute_90"]}
    monkeypatch.setattr(mta, "amp_C", fake)
    monkeypatch.setattr(mta, "_extension_cuda", True)
    monkeypatch.setattr(mta, "_missing_gpu_code", {})
    monkeypatch.setattr(mta, "_fallback_reported", set())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    caplog.set_level(logging.INFO, logger="amp")
    with use_extension(True):
        for _ in range(3):
            assert mta._implementation("multi_tensor_scale", torch.device("cuda", 0)) is _pytorch_ops.multi_tensor_scale
    records = [r for r in caplog.records if r.name == "amp"]
    assert [r.levelno for r in records] == [logging.WARNING]
    message = records[0].getMessage()
    assert "cuda:0 (Tesla V100-SXM2-16GB, sm_70; it was built for sm_80, sm_90, compute_90)" in message
    assert 'TORCH_CUDA_ARCH_LIST="7.0;8.0;9.0+PTX" AMP_CUDA_EXT=1 pip install' in message
