"""amp.initialize: arguments, Properties validation, the opt-level table, casting and return shapes."""
import collections
import copy
import logging
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import amp
from amp._amp_state import _amp_state
from amp.frontend import OPT_LEVELS, Properties
from amp_common import LEVELS, LOW_DTYPE, MASTER_LEVELS, batch, initialized, net, sgd

# Apex's presets, written out here rather than read from amp's table, so that they pin it.
PRESETS = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False, keep_batchnorm_fp32=None,
               master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
               master_weights=None, loss_scale="dynamic"),
    "O2": dict(cast_model_type=torch.float16, patch_torch_functions=False, keep_batchnorm_fp32=True,
               master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type=torch.float16, patch_torch_functions=False, keep_batchnorm_fp32=False,
               master_weights=False, loss_scale=1.0),
    "O4": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
               master_weights=None, loss_scale=1.0),
    "O5": dict(cast_model_type=torch.bfloat16, patch_torch_functions=False, keep_batchnorm_fp32=True,
               master_weights=True, loss_scale=1.0),
}


def test_opt_level_table_holds_apexs_six_presets_and_o1_o4_patch_types():
    assert list(OPT_LEVELS) == list(PRESETS)
    assert {name: level.options for name, level in OPT_LEVELS.items()} == PRESETS
    assert {name: level.patch_type for name, level in OPT_LEVELS.items()} == {
        "O0": None, "O1": torch.float16, "O2": None, "O3": None, "O4": torch.bfloat16, "O5": None}


@pytest.mark.parametrize("opt_level", LEVELS)
def test_only_o1_and_o4_patch_torch_functions_each_to_its_dtype(opt_level):
    initialized(opt_level)
    x = torch.ones(2, 2)
    expected = {"O1": torch.float16, "O4": torch.bfloat16}.get(opt_level, torch.float32)
    assert torch.mm(x, x).dtype == expected


@pytest.mark.parametrize("opt_level", LEVELS)
def test_preset_sets_the_options_of_the_opt_level_table(opt_level):
    initialized(opt_level)
    options = _amp_state.opt_properties.options
    assert options == dict(enabled=True, opt_level=opt_level, **PRESETS[opt_level])


@pytest.mark.parametrize("opt_level", LEVELS)
def test_model_dtypes_follow_the_opt_level(opt_level):
    model, _ = initialized(opt_level)
    if opt_level in ("O0", "O1", "O4"):
        expected_linear = expected_bn = torch.float32
    elif opt_level in MASTER_LEVELS:
        expected_linear, expected_bn = LOW_DTYPE[opt_level], torch.float32
    else:
        expected_linear = expected_bn = torch.float16
    for module in (model.fc1, model.fc2):
        assert {p.dtype for p in module.parameters()} == {expected_linear}
    assert {t.dtype for t in (model.bn.weight, model.bn.bias, model.bn.running_mean)} == {expected_bn}


@pytest.mark.parametrize("opt_level", ["O0", "O2", "O3", "O5"])
def test_forward_casts_inputs_to_the_model_type_and_outputs_to_fp32(opt_level):
    seen = {}
    model = net()
    model.fc1.register_forward_pre_hook(lambda module, args: seen.update(dtype=args[0].dtype))
    model = amp.initialize(model, opt_level=opt_level, verbosity=0)
    out = model(batch(0))
    assert seen["dtype"] == PRESETS[opt_level]["cast_model_type"]
    assert out.dtype == torch.float32


class Echo(nn.Module):
    """Returns its input, so the test sees exactly what the patched forward passed in."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, inputs):
        self.seen = inputs
        return inputs


Pair = collections.namedtuple("Pair", "features label")


class Batch:
    """A user's batch object: amp calls its ``.to(dtype)``."""

    def __init__(self, data):
        self.data = data

    def to(self, dtype):
        return Batch(self.data.to(dtype))


def echo(opt_level="O2"):
    return amp.initialize(Echo(), opt_level=opt_level, verbosity=0)


def test_forward_keeps_ordered_dict_inputs_and_casts_their_tensors():
    model = echo()
    model(collections.OrderedDict(b=torch.ones(2), a=torch.ones(2)))
    assert type(model.seen) is collections.OrderedDict
    assert list(model.seen) == ["b", "a"]
    assert model.seen["a"].dtype == torch.float16


def test_forward_keeps_defaultdict_inputs_with_their_factory():
    model = echo()
    inputs = collections.defaultdict(list, x=torch.ones(2))
    model(inputs)
    assert type(model.seen) is collections.defaultdict
    assert model.seen.default_factory is list
    assert model.seen["x"].dtype == torch.float16


def test_forward_keeps_namedtuple_inputs_and_leaves_integer_tensors_alone():
    model = echo()
    out = model(Pair(torch.ones(2), torch.tensor([1, 2])))
    assert type(model.seen) is Pair
    assert model.seen.features.dtype == torch.float16
    assert model.seen.label.dtype == torch.int64
    assert type(out) is Pair and out.features.dtype == torch.float32


def test_forward_calls_to_on_custom_batch_objects():
    model = echo()
    model(Batch(torch.ones(2)))
    assert isinstance(model.seen, Batch) and model.seen.data.dtype == torch.float16


def test_forward_passes_strings_through():
    model = echo()
    model(["name", torch.ones(1)])
    assert model.seen[0] == "name" and model.seen[1].dtype == torch.float16


def test_forward_passes_numpy_arrays_and_scalars_through_untouched():
    array, scalar = np.ones(3, dtype=np.float32), np.float64(2.0)
    model = echo()
    model({"array": array, "scalar": scalar, "x": torch.ones(1)})
    assert model.seen["array"] is array and model.seen["scalar"] is scalar
    assert model.seen["x"].dtype == torch.float16


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_cast_model_outputs_forces_the_output_dtype(opt_level):
    model = amp.initialize(net(), opt_level=opt_level, cast_model_outputs=torch.float16, verbosity=0)
    assert model(batch(0)).dtype == torch.float16


@pytest.mark.parametrize("opt_level", ["O2", "O3", "O5"])
def test_model_state_dict_is_fp32(opt_level):
    model, _ = initialized(opt_level)
    state = model.state_dict()
    assert {v.dtype for k, v in state.items() if not k.endswith("num_batches_tracked")} == {torch.float32}


def test_model_state_dict_under_master_weights_holds_the_exact_fp32_masters():
    reference = net().state_dict()
    model, _ = initialized("O2")
    assert torch.equal(model.state_dict()["fc1.weight"], reference["fc1.weight"])


class RotaryTable(nn.Module):
    """A linear layer scaled by a float64 table whose steps (1e-10) fp16, bf16 and fp32 round away."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("table", 1 + torch.arange(4, dtype=torch.float64) * 1e-10)

    def forward(self, x):
        return self.fc(x) * self.table.to(x.dtype)


@pytest.mark.parametrize("keep_batchnorm_fp32", [None, False])
@pytest.mark.parametrize("opt_level", ["O0", "O2", "O3", "O5"])
def test_float64_buffers_keep_their_dtype_and_values_when_the_model_is_cast(opt_level, keep_batchnorm_fp32):
    reference = RotaryTable()
    model = copy.deepcopy(reference)
    model = amp.initialize(model, opt_level=opt_level, keep_batchnorm_fp32=keep_batchnorm_fp32,
                           verbosity=0)
    assert model.table.dtype == torch.float64 and torch.equal(model.table, reference.table)
    saved = model.state_dict()["table"]
    assert saved.dtype == torch.float64 and torch.equal(saved, reference.table)
    assert model.fc.weight.dtype == OPT_LEVELS[opt_level].options["cast_model_type"]
    assert model(batch(0)).dtype == torch.float32


def test_models_stay_on_cpu():
    model, optimizer = initialized("O2")
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert {p.device.type for p in amp.master_params(optimizer)} == {"cpu"}


# Return shapes (Apex's table): the same, mutated objects come back.
def test_single_model_without_optimizer_returns_the_model():
    model = net()
    assert amp.initialize(model, opt_level="O1", verbosity=0) is model


def test_single_model_and_optimizer_return_a_pair_of_the_same_objects():
    model = net()
    optimizer = sgd(model.parameters())
    out = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    assert type(out) is tuple and out[0] is model and out[1] is optimizer


def test_list_of_models_without_optimizer_returns_the_list():
    models = [net(), net(1)]
    out = amp.initialize(models, opt_level="O1", verbosity=0)
    assert type(out) is list and out[0] is models[0] and out[1] is models[1]


def test_list_of_models_and_single_optimizer_return_list_and_optimizer():
    models = [net(), net(1)]
    optimizer = sgd(list(models[0].parameters()) + list(models[1].parameters()))
    out_models, out_optimizer = amp.initialize(models, optimizer, opt_level="O1", verbosity=0)
    assert type(out_models) is list and out_optimizer is optimizer


def test_list_of_optimizers_returns_a_list():
    model = net()
    optimizers = [sgd(model.fc1.parameters()), sgd(list(model.bn.parameters()) + list(model.fc2.parameters()))]
    out_model, out_optimizers = amp.initialize(model, optimizers, opt_level="O2", verbosity=0)
    assert out_model is model
    assert type(out_optimizers) is list and all(a is b for a, b in zip(out_optimizers, optimizers))


def test_tuple_of_optimizers_returns_a_tuple():
    model = net()
    optimizers = (sgd(model.fc1.parameters()), sgd(list(model.bn.parameters()) + list(model.fc2.parameters())))
    _, out_optimizers = amp.initialize(model, optimizers, opt_level="O2", verbosity=0)
    assert type(out_optimizers) is tuple and all(a is b for a, b in zip(out_optimizers, optimizers))


def test_empty_list_of_optimizers_returns_a_pair():
    model = net()
    out = amp.initialize(model, [], opt_level="O1", verbosity=0)
    assert out == (model, [])


# Errors.
def test_tuple_of_models_is_a_type_error():
    with pytest.raises(TypeError, match="single model or a list of models"):
        amp.initialize((net(), net(1)), opt_level="O1", verbosity=0)


def test_non_optimizer_is_a_type_error():
    with pytest.raises(TypeError, match="single optimizer or a list of optimizers"):
        amp.initialize(net(), "sgd", opt_level="O1", verbosity=0)


def test_same_optimizer_twice_in_one_call_is_an_error():
    model = net()
    optimizer = sgd(model.parameters())
    with pytest.raises(RuntimeError, match="more than once"):
        amp.initialize(model, [optimizer, optimizer], opt_level="O2", verbosity=0)


def test_optimizer_passed_through_initialize_again_is_an_error():
    model, optimizer = initialized("O1")
    with pytest.raises(RuntimeError, match="only be passed through amp.initialize once"):
        amp.initialize(net(1), optimizer, opt_level="O1", verbosity=0)


def test_model_in_data_parallel_is_an_error():
    with pytest.raises(RuntimeError, match="AFTER the model"):
        amp.initialize(nn.DataParallel(net()), opt_level="O2", verbosity=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_model_is_an_error(dtype):
    with pytest.raises(RuntimeError, match="do not need to call .half()"):
        amp.initialize(net().to(dtype), opt_level="O2", verbosity=0)


def test_low_precision_model_is_accepted_with_allow_incoming_model_not_fp32():
    _amp_state.allow_incoming_model_not_fp32 = True
    model = amp.initialize(net().half(), opt_level="O2", verbosity=0)
    assert model.fc1.weight.dtype == torch.float16


@pytest.mark.parametrize("opt_level", ["o1", "01", "O6", None])
def test_unknown_opt_level_is_a_runtime_error_naming_the_options(opt_level):
    with pytest.raises(RuntimeError, match="Options are 'O0', 'O1', 'O2', 'O3', 'O4', 'O5'.*letter O"):
        amp.initialize(net(), opt_level=opt_level, verbosity=0)


@pytest.mark.parametrize("keyword, value", [
    ("num_losses", 0), ("hysteresis", 0), ("verbosity", 5), ("max_consecutive_skips", -1),
    ("growth_interval", 0), ("num_losses", 1.5), ("max_consecutive_skips", True),
    ("max_steps_at_scale_floor", -1), ("max_steps_at_scale_floor", 2.5)])
def test_bad_keyword_value_is_a_value_error_naming_it(keyword, value):
    with pytest.raises(ValueError, match=keyword):
        amp.initialize(net(), opt_level="O2", **{keyword: value})


# Properties validation (Apex's rules; O4/O5 validate like O1/O2).
@pytest.mark.parametrize("opt_level", ["O1", "O4"])
@pytest.mark.parametrize("override", [
    dict(cast_model_type=torch.float16), dict(cast_model_type=torch.bfloat16),
    dict(keep_batchnorm_fp32=True), dict(keep_batchnorm_fp32=False),
    dict(master_weights=True), dict(master_weights=False)])
def test_patching_levels_reject_model_casting_overrides(opt_level, override):
    with pytest.raises(RuntimeError, match=opt_level):
        amp.initialize(net(), opt_level=opt_level, verbosity=0, **override)


@pytest.mark.parametrize("opt_level", ["O0", "O2", "O3", "O5"])
def test_patch_torch_functions_outside_patching_levels_is_an_error(opt_level):
    with pytest.raises(RuntimeError, match="patch_torch_functions=True should only be set"):
        amp.initialize(net(), opt_level=opt_level, patch_torch_functions=True, verbosity=0)


@pytest.mark.parametrize("opt_level", ["O1", "O4"])
@pytest.mark.parametrize("value", [False, torch.float32])
def test_patching_levels_accept_cast_model_type_false_or_fp32(opt_level, value):
    model = amp.initialize(net(), opt_level=opt_level, cast_model_type=value, verbosity=0)
    assert model.fc1.weight.dtype == torch.float32


def test_hard_override_warns_instead_of_raising():
    _amp_state.hard_override = True
    with pytest.warns(UserWarning, match="It doesn't make sense to use master_weights with O1"):
        amp.initialize(net(), opt_level="O1", master_weights=True, verbosity=0)
    assert _amp_state.opt_properties.master_weights is True


@pytest.mark.parametrize("text, value", [("True", True), ("False", False)])
def test_keep_batchnorm_fp32_accepts_the_strings_true_and_false(text, value):
    model = amp.initialize(net(), opt_level="O2", keep_batchnorm_fp32=text, verbosity=0)
    assert _amp_state.opt_properties.keep_batchnorm_fp32 is value
    assert model.bn.weight.dtype == (torch.float32 if value else torch.float16)


def test_keep_batchnorm_fp32_rejects_other_values():
    with pytest.raises(ValueError, match="keep_batchnorm_fp32"):
        amp.initialize(net(), opt_level="O2", keep_batchnorm_fp32="yes", verbosity=0)


def test_loss_scale_string_number_becomes_a_float():
    amp.initialize(net(), opt_level="O2", loss_scale="128.0", verbosity=0)
    assert _amp_state.opt_properties.loss_scale == 128.0
    assert not _amp_state.loss_scalers[0].dynamic and _amp_state.loss_scalers[0].loss_scale() == 128.0


@pytest.mark.parametrize("value", ["big", -1, 0, float("inf")])
def test_loss_scale_that_is_not_a_positive_number_is_a_value_error(value):
    with pytest.raises(ValueError, match="loss_scale"):
        amp.initialize(net(), opt_level="O2", loss_scale=value, verbosity=0)


def test_cast_model_type_false_keeps_an_o2_model_fp32():
    model = amp.initialize(net(), opt_level="O2", cast_model_type=False, verbosity=0)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_keep_batchnorm_fp32_false_casts_batchnorm_under_o2():
    model = amp.initialize(net(), opt_level="O2", keep_batchnorm_fp32=False, verbosity=0)
    assert model.bn.weight.dtype == torch.float16


def test_master_weights_false_under_o2_steps_the_model_params_themselves():
    model, optimizer = initialized("O2", master_weights=False)
    assert [p for p in amp.master_params(optimizer)] == list(model.parameters())


def test_num_losses_creates_one_scaler_per_loss():
    initialized("O2", num_losses=3)
    assert len(_amp_state.loss_scalers) == 3


def test_loss_scale_bounds_and_growth_options_shape_the_scaler():
    initialized("O2", min_loss_scale=4.0, max_loss_scale=2.0**10)
    assert _amp_state.min_loss_scale == 4.0 and _amp_state.max_loss_scale == 2.0**10
    assert _amp_state.loss_scalers[0].loss_scale() == 2.0**10  # init 2**16 capped at the max


def test_unknown_property_is_an_attribute_error_naming_the_class():
    with pytest.raises(AttributeError, match="Properties"):
        Properties().no_such_option


def test_verbosity_zero_logs_nothing_at_initialize(caplog, capsys):
    with caplog.at_level(logging.DEBUG, logger="amp"):
        initialized("O2", verbosity=0)
    assert caplog.records == [] and capsys.readouterr().out == ""


def test_verbosity_one_logs_the_options_table_to_the_amp_logger(caplog, capsys):
    with caplog.at_level(logging.INFO, logger="amp"):
        initialized("O2", verbosity=1)
    assert {record.name for record in caplog.records} == {"amp"}
    assert "Selected optimization level O2" in caplog.text
    assert "master_weights         : True" in caplog.text
    assert capsys.readouterr().out == ""  # nothing printed: logging is the user's to route


def test_disabled_returns_the_inputs_and_scale_loss_passes_the_loss_through():
    model = net()
    optimizer = sgd(model.parameters())
    out = amp.initialize(model, optimizer, enabled=False, opt_level="bogus")
    assert out[0] is model and out[1] is optimizer
    assert not hasattr(optimizer, "_amp_stash")
    loss = model(batch(0)).sum()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        assert scaled_loss is loss


def test_reinitializing_o1_then_o2_on_new_objects_turns_the_o1_casts_off_outside_models():
    x = batch(0)
    initialized("O1")
    assert nn.functional.linear(x, torch.ones(2, 4)).dtype == torch.float16
    model, optimizer = initialized("O2", seed=1)
    assert nn.functional.linear(x, torch.ones(2, 4)).dtype == torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = model(x).pow(2).mean()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()


def test_reinitializing_discards_the_old_loss_scalers():
    initialized("O2", num_losses=2)
    old = list(_amp_state.loss_scalers)
    initialized("O1", seed=1)
    assert len(_amp_state.loss_scalers) == 1 and _amp_state.loss_scalers[0] not in old
