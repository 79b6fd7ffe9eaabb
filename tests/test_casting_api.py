"""The handle's life cycle, disable_casts, user registration, decorators and verbose output."""
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp
import amp.casting
from amp._amp_state import _amp_state
from amp.casting import lists
from amp_common import batch, initialized, train_step


def _patched_attributes():
    """(owner, name) of everything init may patch, with the object there now."""
    names = []
    for ovr in lists.overrides(torch.float16) + lists.overrides(torch.bfloat16):
        for group in (ovr.low_precision, ovr.fp32, ovr.promote, ovr.sequence_promote, ovr.banned):
            names += [(ovr.module, n) for n in group]
            names += [(ovr.module, n + "_") for n in group if hasattr(ovr.module, n + "_")]
    names += [(torch.nn.modules.rnn, "_VF"), (torch.nn.modules.rnn.RNNBase, "check_input")]
    return {(owner, name): vars(owner).get(name, getattr(owner, name)) for owner, name in names}


def test_deactivate_restores_every_original(low, fresh_state):
    before = _patched_attributes()
    tensor_dict_before = set(vars(torch.Tensor))
    handle = amp.casting.init(patch_type=low)
    assert torch.mm is not before[(torch, "mm")]
    handle._deactivate()
    after = _patched_attributes()
    changed = [name for (owner, name) in before if after[owner, name] is not before[owner, name]]
    assert changed == []
    assert torch.nn.modules.rnn._VF is torch._VF
    assert set(vars(torch.Tensor)) == tensor_dict_before  # inherited methods inherited again



@pytest.mark.parametrize("opt_level", ["O1", "O4"])
def test_public_deactivate_undoes_initialize(opt_level):
    before = _patched_attributes()
    model, optimizer = initialized(opt_level)
    assert torch.mm is not before[(torch, "mm")]
    amp.deactivate()
    after = _patched_attributes()
    assert [name for (owner, name) in before if after[owner, name] is not before[owner, name]] == []
    with pytest.raises(RuntimeError, match="dtype"):
        torch.mm(torch.ones(2, 2, dtype=torch.float16), torch.ones(2, 2))  # plain torch refuses
    assert model(batch(0)).dtype == torch.float32
    train_step(model, optimizer, 0)  # the earlier run's optimizer still steps, without casts
    amp.deactivate()  # nothing patched: a no-op
    assert _amp_state.handle is None
    train_step(*initialized("O2"), 1)


def test_new_init_removes_previous_patches(low, fresh_state):
    original = torch.mm
    amp.casting.init(patch_type=torch.float16)
    second = amp.casting.init(patch_type=low)
    assert torch.mm.__wrapped__ is original
    x = torch.randn(2, 2)
    assert torch.mm(x, x).dtype == low
    second._deactivate()
    assert torch.mm is original


def test_tensors_stay_hashable(handle):
    x = torch.randn(2)
    assert {x: 1}[x] == 1


def test_disable_casts_is_exception_safe(handle, low):
    x = torch.randn(2, 2)
    with pytest.raises(KeyError):
        with amp.disable_casts():
            assert torch.mm(x, x).dtype == torch.float32
            raise KeyError
    assert handle.is_active()
    assert torch.mm(x, x).dtype == low


def test_disable_casts_without_handle_is_a_noop(fresh_state):
    _amp_state.handle = None
    with amp.disable_casts():
        pass


def test_disabled_init_returns_noop_handle(fresh_state):
    original = torch.mm
    handle = amp.casting.init(enabled=False)
    assert isinstance(handle, amp.casting.NoOpHandle) and not handle.is_active()
    assert torch.mm is original
    with handle.scale_loss(torch.ones(()), None) as loss:
        assert loss.item() == 1


def test_old_scale_loss_api_raises(handle):
    with pytest.raises(RuntimeError, match="amp.scale_loss"):
        handle.scale_loss(torch.ones(()), None)


def test_unknown_patch_type_is_rejected(fresh_state):
    with pytest.raises(ValueError, match="patch_type"):
        amp.casting.init(patch_type=torch.float64)


@pytest.mark.parametrize("register,dtype", [
    (amp.register_half_function, torch.float16),
    (amp.register_bfloat16_function, torch.bfloat16),
    (amp.register_float_function, torch.float32),
], ids=["half", "bfloat16", "float"])
def test_registered_function_runs_in_its_type(fresh_state, low, register, dtype):
    register(torch, "sigmoid")
    amp.casting.init(patch_type=low)
    assert torch.sigmoid(torch.randn(3).to(low if dtype == torch.float32 else torch.float32)).dtype == dtype


def test_registered_promote_function_runs_in_widest_type(fresh_state, low):
    amp.register_promote_function(torch, "hypot")
    amp.casting.init(patch_type=low)
    assert torch.hypot(torch.randn(3).to(low), torch.randn(3)).dtype == torch.float32


def test_registration_overrides_the_lists(fresh_state, low):
    amp.register_float_function(F, "linear")
    amp.casting.init(patch_type=low)
    assert nn.Linear(3, 3)(torch.randn(2, 3)).dtype == torch.float32


def test_registrations_last_until_deactivate(fresh_state, low):
    original = torch.sigmoid
    amp.register_half_function(torch, "sigmoid")
    amp.casting.init(patch_type=low)
    amp.casting.init(patch_type=low)  # an earlier run's registration stays for its models
    assert torch.sigmoid(torch.randn(3)).dtype == torch.float16
    amp.deactivate()
    amp.casting.init(patch_type=low)
    assert torch.sigmoid is original


def test_registration_after_init_applies_at_once(fresh_state, low):
    amp.casting.init(patch_type=low)
    x = torch.randn(2, 2)
    assert torch.mm(x, x).dtype == low
    amp.register_float_function(torch, "mm")
    assert torch.mm(x, x).dtype == torch.float32
    amp.casting.init(patch_type=low)  # and for later initialize calls
    assert torch.mm(x, x).dtype == torch.float32


def test_registration_after_initialize_applies_inside_the_model(fresh_state):
    model, optimizer = initialized("O1")
    assert model(batch(0)).dtype == torch.float16
    amp.register_float_function(F, "linear")
    assert model(batch(0)).dtype == torch.float32
    train_step(model, optimizer, 0)


def test_promote_registration_after_init_applies_at_once(fresh_state, low):
    amp.casting.init(patch_type=low)
    amp.register_promote_function(torch, "vdot")  # plain vdot refuses mixed dtypes
    assert torch.vdot(torch.ones(3).to(low), torch.ones(3)).dtype == torch.float32


def test_registering_again_after_init_replaces_the_registration(fresh_state, low):
    original = torch.sigmoid
    amp.casting.init(patch_type=low)
    amp.register_half_function(torch, "sigmoid")
    amp.register_float_function(torch, "sigmoid")  # the latest registration wins
    assert torch.sigmoid.__wrapped__ is original
    assert torch.sigmoid(torch.randn(2).to(low)).dtype == torch.float32
    amp.deactivate()
    assert torch.sigmoid is original


def test_registering_a_missing_name_raises(fresh_state):
    with pytest.raises(ValueError, match="No function named nope"):
        amp.register_half_function(torch, "nope")


@pytest.mark.parametrize("decorator,dtype", [
    (amp.half_function, torch.float16),
    (amp.bfloat16_function, torch.bfloat16),
    (amp.float_function, torch.float32),
], ids=["half", "bfloat16", "float"])
def test_decorator_casts_only_while_active(fresh_state, low, decorator, dtype):
    @decorator
    def identity_dtype(t):
        return t.dtype

    x = torch.randn(2).to(torch.float64)
    assert identity_dtype(x) == torch.float64  # before init: untouched
    handle = amp.casting.init(patch_type=low)
    assert identity_dtype(x) == dtype
    with amp.disable_casts():
        assert identity_dtype(x) == torch.float64
    handle._deactivate()
    assert identity_dtype(x) == torch.float64


def test_promote_decorator_casts_to_widest(handle, low):
    @amp.promote_function
    def dtypes(a, b):
        return a.dtype, b.dtype

    assert dtypes(torch.ones(1).to(low), torch.ones(1)) == (torch.float32, torch.float32)


def test_verbose_logs_each_cast(fresh_state, low, caplog):
    amp.casting.init(patch_type=low, verbose=True)
    name = {torch.float16: "Half", torch.bfloat16: "BFloat16"}[low]
    x = torch.randn(2, 2)
    with caplog.at_level(logging.INFO, logger="amp"):
        torch.mm(x, x.to(low))
        torch.exp(x.to(low))
    assert caplog.messages == [f"Float->{name} (mm)", f"{name}->Float (exp)"]


class _MatmulInFloat(torch.autograd.Function):
    """What ``torch.amp.custom_fwd(cast_inputs=torch.float32)`` asks of autocast, written for amp's
    O1/O4 (which custom_fwd does not see): fp32 inputs, and no casts inside."""

    @staticmethod
    @amp.float_function
    def forward(ctx, x, w):
        with amp.disable_casts():
            return x @ w

    @staticmethod
    def backward(ctx, grad):
        return None, None


@pytest.mark.parametrize("opt_level", ["O1", "O4"])
def test_float_function_with_disable_casts_runs_a_custom_function_in_fp32(opt_level):
    model = amp.initialize(nn.Linear(4, 4), opt_level=opt_level, verbosity=0)
    x = torch.randn(2, 4).half()
    assert (x @ model.weight).dtype != torch.float32  # O1/O4 would cast the matmul
    out = _MatmulInFloat.apply(x, model.weight)
    assert out.dtype == torch.float32
    with amp.disable_casts():  # the fp32 reference, computed where amp casts nothing
        assert torch.equal(out, x.float() @ model.weight.detach())
