"""The modules of Apex's ``apex.amp`` that the switch serves from the mirror (``amp._apex.apex.amp``),
and Apex's names on amp's own modules, in this process (the switch itself: test_apex_switch.py).

Each name either works as Apex's did, on amp, checked against plain torch on the same data, or
raises with what replaces it.
"""
import pytest
import torch
from torch import nn

import amp
from amp import _amp_state as amp_state_module_object
from amp._apex.apex.amp import _process_optimizer, compat, opt, rnn_compat, utils, wrap
from amp._apex.apex.amp import __version__ as version_module
from amp._apex.apex.amp import amp as apex_amp_module
from amp._apex.apex.amp.lists import functional_overrides, tensor_overrides, torch_overrides
from amp.casting import lists
from amp_common import batch, initialized, loss_of

LIST_MODULES = {"functional": (functional_overrides, torch.nn.functional),
                "torch": (torch_overrides, torch), "tensor": (tensor_overrides, torch.Tensor)}


@pytest.mark.parametrize("name", LIST_MODULES)
def test_apexs_lists_are_amps_o1_lists_resolved_against_this_torch(name):
    apex_list, module = LIST_MODULES[name]
    resolved = dict(zip(LIST_MODULES, lists.overrides(torch.float16)))[name]
    assert apex_list.MODULE is module
    assert list(apex_list.FP16_FUNCS) == list(resolved.low_precision) and "layer_norm" not in apex_list.FP16_FUNCS
    assert list(apex_list.FP32_FUNCS) == list(resolved.fp32)
    assert all(hasattr(module, fn) for fn in (*apex_list.FP16_FUNCS, *apex_list.FP32_FUNCS))
    if name != "functional":
        assert list(apex_list.CASTS) == list(resolved.promote)
        assert list(apex_list.SEQUENCE_CASTS) == list(resolved.sequence_promote)


def test_banned_functions_carry_the_error_amp_raises():
    assert functional_overrides.BANNED_FUNCS[0][0] == "binary_cross_entropy"
    assert functional_overrides.BANNED_FUNCS[0][1] == lists.FUNCTIONAL_BANNED["binary_cross_entropy"]


@pytest.mark.parametrize("edit", [lambda l: l.append("exp"), lambda l: l.remove("mm"), lambda l: l.extend(["x"]),
                                  lambda l: l.__iadd__(["x"]), lambda l: l.__setitem__(0, "x")],
                         ids=["append", "remove", "extend", "iadd", "setitem"])
def test_editing_a_list_says_which_call_changes_what_amp_patches(edit):
    with pytest.raises(TypeError, match="register_half_function"):
        edit(torch_overrides.FP16_FUNCS)
    assert "mm" in torch_overrides.FP16_FUNCS


def test_version_module_holds_amps_version():
    assert version_module.__version__ == amp.__version__
    assert ".".join(map(str, version_module.VERSION)) == amp.__version__


def test_apex_amp_amp_holds_amps_own_functions():
    assert apex_amp_module.init is amp.init and apex_amp_module.initialize is amp.initialize
    assert apex_amp_module.half_function is amp.half_function
    assert apex_amp_module.register_float_function is amp.register_float_function
    assert apex_amp_module._amp_state is amp._amp_state and apex_amp_module.utils is utils


def test_compat_answers_for_pytorch_after_the_tensor_variable_merge():
    assert compat.variable_is_tensor() and not compat.tensor_is_variable() and not compat.tensor_is_float_tensor()
    assert compat.is_floating_point(torch.zeros(1, dtype=torch.bfloat16)) and not compat.is_floating_point(3.0)
    assert compat.scalar_python_val(torch.tensor([2.5])) == 2.5 and compat.scalar_python_val([4]) == 4
    assert compat.filter_attrs(torch, ["mm", "no_such_function", "bmm"]) == ["mm", "bmm"]
    assert compat.is_tensor_like(torch.zeros(1)) and not compat.is_tensor_like([1])


def test_utils_cast_helpers_cast_floating_tensors_and_leave_the_rest():
    x, i = torch.randn(3), torch.arange(3)
    assert utils.maybe_half(x).dtype == torch.float16 and torch.equal(utils.maybe_half(x), x.half())
    assert utils.maybe_float(x.half()).dtype == torch.float32
    assert [t.dtype for t in utils.maybe_half([x, x])] == [torch.float16] * 2
    kwargs = dict(other=x)
    args = utils.casted_args(utils.maybe_half, [x, i, "s"], kwargs)
    assert [a.dtype if isinstance(a, torch.Tensor) else a for a in args] == [torch.float16, torch.int64, "s"]
    assert kwargs["other"].dtype == torch.float16
    assert utils.collect_fp_tensor_types([x.half(), [x, x]], dict(y=i)) == {"HalfTensor", "FloatTensor"}
    assert utils.is_fp_tensor([x, x.half()]) and not utils.is_fp_tensor([x, i])
    assert utils.should_cache(nn.Parameter(x)) and not utils.should_cache(x)
    assert list(utils.as_inplace(["exp", "log"])) == ["exp_", "log_"]


def test_utils_cached_cast_reuses_a_parameters_cast_until_it_changes():
    param = nn.Parameter(torch.randn(4))
    cache = {}
    first = utils.cached_cast(utils.maybe_half, param, cache)
    assert utils.cached_cast(utils.maybe_half, param, cache) is first and torch.equal(first, param.half())
    with torch.no_grad():
        param.add_(1.0)
    refreshed = utils.cached_cast(utils.maybe_half, param, cache)
    assert refreshed is not first and torch.equal(refreshed, param.half())


def test_utils_flattened_rnn_weights_are_views_of_the_flat_buffer_with_the_values_of_the_weights():
    flat32 = torch.randn(20)
    weights = [flat32[0:12].view(3, 4), flat32[12:20].view(8)]
    flat16 = torch.empty(20, dtype=torch.float16)
    views = utils.new_synthesize_flattened_rnn_weights(weights, flat16)
    assert torch.equal(flat16, flat32.half()) and [v.shape for v in views] == [(3, 4), (8,)]
    assert views[1].data_ptr() == flat16[12:].data_ptr()
    per_layer = utils.synthesize_flattened_rnn_weights([weights], torch.empty(20, dtype=torch.float16))
    assert torch.equal(per_layer[0][1], views[1])


@pytest.fixture
def handle():
    handle = amp.init()
    yield handle
    amp.deactivate()


class Holder:
    @staticmethod
    def mix(a, b):
        return a + b

    @staticmethod
    def seen(*args):
        return [a.dtype for a in args]


def test_wrap_cached_cast_patches_through_the_handle_and_deactivate_restores_it(handle):
    original = Holder.__dict__["seen"]
    wrap.cached_cast(Holder, "seen", utils.maybe_half, handle)
    assert Holder.seen(torch.zeros(1), torch.zeros(1, dtype=torch.float64)) == [torch.float16, torch.float16]
    with handle._disable_casts():
        assert Holder.seen(torch.zeros(1)) == [torch.float32]
    amp.deactivate()
    assert Holder.__dict__["seen"] is original


def test_wrap_promote_casts_mixed_arguments_to_the_widest_type(handle):
    wrap.promote(Holder, "mix", handle)
    out = Holder.mix(torch.ones(2, dtype=torch.float16), torch.full((2,), 0.5))
    assert out.dtype == torch.float32 and torch.equal(out, torch.full((2,), 1.5))


def test_wrap_err_if_any_half_refuses_low_precision_arguments(handle):
    wrap.err_if_any_half(Holder, "seen", handle, "no fp16 here")
    assert Holder.seen(torch.zeros(1)) == [torch.float32]
    with pytest.raises(NotImplementedError, match="no fp16 here"):
        Holder.seen(torch.zeros(1, dtype=torch.float16))


def test_wrap_disable_casts_runs_the_function_with_the_handles_casts_off(handle):
    wrap.cached_cast(Holder, "seen", utils.maybe_half, handle)
    wrap.disable_casts(Holder, "seen", handle)
    assert Holder.seen(torch.zeros(1)) == [torch.float32]


def test_wrap_rnn_cast_of_pytorch_0_4_says_what_replaces_it(handle):
    with pytest.raises(RuntimeError, match="new_rnn_cast"):
        wrap.rnn_cast(None, "RNN", handle)


def test_rnn_compat_shim_forwards_to_torchs_kernels_and_whitelisting_needs_a_shim(monkeypatch):
    from amp._compat import rnn_module

    shim = rnn_compat.VariableFunctionsShim()
    assert set(rnn_compat.RNN_NAMES) == {"rnn_tanh", "rnn_relu", "gru", "lstm"} and not rnn_compat.has_old_rnns()
    cell = nn.GRUCell(3, 4)
    x, h = torch.randn(2, 3), torch.randn(2, 4)
    assert torch.equal(shim.gru_cell(x, h, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh), cell(x, h))
    monkeypatch.setattr(rnn_module(), "_VF", torch._VF)
    with pytest.raises(RuntimeError, match="call amp.init"):
        rnn_compat.whitelist_rnn_cells(amp.casting.NoOpHandle(), False)


def test_rnn_compat_whitelisted_cells_run_in_fp16(monkeypatch):
    from amp._compat import rnn_module

    monkeypatch.setattr(rnn_module(), "_VF", rnn_compat.VariableFunctionsShim())
    handle = amp.casting.AmpHandle()  # patches nothing itself: only what is saved through it
    cell, x = nn.GRUCell(3, 4), torch.randn(2, 3)
    assert cell(x).dtype == torch.float32
    rnn_compat.whitelist_rnn_cells(handle, verbose=False)
    out = cell(x)
    handle._uninstall()
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), cell(x), rtol=2e-2, atol=2e-3)


def test_the_first_apis_optimizer_wrapper_says_what_replaces_it():
    with pytest.raises(RuntimeError, match="amp.initialize"):
        opt.OptimWrapper(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), None, 1)


def test_post_backward_models_are_masters_unscales_and_adds_the_stash_as_plain_arithmetic():
    scaler = amp.LossScaler("dynamic", init_scale=8.0)
    params = [nn.Parameter(torch.zeros(3)) for _ in range(3)]
    grads = [torch.tensor([8.0, 16.0, -4.0]), torch.tensor([2.0, 4.0, 6.0]), None]
    stash = [None, torch.tensor([1.0, 1.0, 1.0]), torch.tensor([5.0, 5.0, 5.0])]
    for param, grad in zip(params, grads):
        param.grad = None if grad is None else grad.clone()
    expected = [grads[0] / 8, grads[1] / 8 + stash[1], stash[2]]
    _process_optimizer.post_backward_models_are_masters(scaler, params, stash)
    assert all(torch.equal(p.grad, e) for p, e in zip(params, expected)) and stash == [None] * 3


def test_process_optimizer_functions_drive_an_optimizer_amp_initialized_and_refuse_others():
    model, optimizer = initialized("O2")
    _process_optimizer.lazy_init_with_master_weights(optimizer)
    assert isinstance(optimizer._amp_stash, _process_optimizer.AmpOptimizerState)
    loss_of(model(batch(0))).backward()  # without scale_loss: Apex's functions unscale by hand
    _process_optimizer.post_backward_with_master_weights(optimizer, amp._amp_state.loss_scalers[0])
    masters = list(amp.master_params(optimizer))
    assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in masters)
    with pytest.raises(RuntimeError, match="amp.initialize"):
        _process_optimizer.prepare_backward_no_master_weights(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="amp.initialize"):
        _process_optimizer._process_optimizer(optimizer, None)


def test_amp_state_module_has_apexs_helpers():
    from amp._amp_state import master_params, warn_or_err

    with pytest.raises(RuntimeError, match="not allowed"):
        warn_or_err("not allowed")
    amp._amp_state.hard_override = True
    with pytest.warns(UserWarning, match="not allowed"):
        warn_or_err("not allowed")
    model, optimizer = initialized("O2")
    assert list(master_params(optimizer)) == list(amp.master_params(optimizer))
    assert amp_state_module_object is amp._amp_state


def test_frontends_opt_level_objects_apply_amps_presets_to_properties():
    from amp.frontend import O1, O2, Properties, opt_levels
    from amp.options import OPT_LEVELS

    properties = O2()(Properties())
    assert properties.opt_level == "O2" and properties.enabled
    assert {key: getattr(properties, key) for key in OPT_LEVELS["O2"].options} == OPT_LEVELS["O2"].options
    assert isinstance(opt_levels["O1"], O1) and opt_levels["O1"].brief.startswith("O1:")
    assert sorted(opt_levels) == ["O0", "O1", "O2", "O3", "O4", "O5"]


def test_handle_and_scaler_and_initialize_modules_hold_apexs_names():
    import amp._initialize as initialize_module
    import amp.handle as handle_module
    import amp.scaler as scaler_module

    assert handle_module.AmpHandle is amp.casting.AmpHandle and handle_module.disable_casts is amp.disable_casts
    assert initialize_module.check_models is initialize_module._check_models
    grad = torch.tensor([2.0, -6.0])
    master = torch.empty(2)
    assert not scaler_module.scale_check_overflow_python(grad, master, 0.5, check_overflow=True)
    assert torch.equal(master, torch.tensor([1.0, -3.0]))
    assert scaler_module.scale_check_overflow_python(torch.tensor([float("inf")]), master, 0.5, check_overflow=True)
    assert torch.equal(master, torch.tensor([1.0, -3.0]))  # an overflow writes nothing
    assert not scaler_module.axpby_check_overflow_python(grad.half(), torch.ones(2), master, 0.5, 2.0)
    assert torch.equal(master, torch.tensor([3.0, -1.0]))


def test_o2_state_dict_hook_saves_low_precision_entries_as_fp32():
    import amp._initialize as initialize_module

    layer = nn.Linear(2, 2).half()
    layer._register_state_dict_hook(initialize_module.O2StateDictHook(None))
    state = layer.state_dict()
    assert all(v.dtype == torch.float32 for v in state.values())
    assert torch.equal(state["weight"], layer.weight.float())
