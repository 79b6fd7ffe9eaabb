"""amp.scaler.LossScaler: the dynamic-scaling rule, hysteresis, clamps, checkpoints and unscaling."""
import io

import pytest
import torch

from amp._amp_state import _amp_state
from amp.multi_tensor_apply import use_extension
from amp.scaler import DEFAULT_MIN_LOSS_SCALE, LossScaler
from amp_common import initialized


@pytest.fixture(autouse=True)
def pytorch_path():
    with use_extension(False):
        yield


def grads(dtype, n=(100, 0, 7), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(k, generator=gen) * 1000).to(dtype) for k in n]


def step(scaler, overflow):
    """One backward's worth of scaler traffic; returns should_skip."""
    scaler.clear_overflow_state()
    model = grads(torch.float16)
    if overflow:
        model[0][3] = float("inf")
    scaler.unscale(model, [torch.empty_like(g, dtype=torch.float32) for g in model], None)
    return scaler.update_scale()


def state(scaler):
    sd = scaler.state_dict()
    return sd["loss_scale"], sd["unskipped"], sd["hysteresis_tracker"]


# --- the dynamic rule ------------------------------------------------------------------------------

def test_overflow_skips_the_step_and_halves_the_scale():
    scaler = LossScaler("dynamic")
    assert step(scaler, overflow=True) is True
    assert scaler.loss_scale() == 2.0**15


def test_backoff_defaults_to_one_over_scale_factor():
    scaler = LossScaler("dynamic", scale_factor=4.0)
    step(scaler, overflow=True)
    assert scaler.loss_scale() == 2.0**14


def test_explicit_backoff_factor_is_honoured():
    scaler = LossScaler("dynamic", init_scale=1000.0, backoff_factor=0.25)
    step(scaler, overflow=True)
    assert scaler.loss_scale() == 250.0


def test_scale_grows_after_exactly_scale_window_clean_steps():
    scaler = LossScaler("dynamic", init_scale=8.0, scale_factor=3.0, scale_window=3)
    assert [step(scaler, overflow=False) for _ in range(2)] == [False, False]
    assert state(scaler)[:2] == (8.0, 2)
    step(scaler, overflow=False)
    assert state(scaler)[:2] == (24.0, 0)


def test_an_overflow_restarts_the_growth_count():
    scaler = LossScaler("dynamic", init_scale=8.0, scale_window=3)
    step(scaler, overflow=False)
    step(scaler, overflow=False)
    step(scaler, overflow=True)
    for _ in range(2):
        step(scaler, overflow=False)
    assert state(scaler)[:2] == (4.0, 2)


def test_hysteresis_tolerates_n_minus_1_consecutive_overflows_then_backs_off():
    scaler = LossScaler("dynamic", init_scale=64.0, hysteresis=3)
    assert step(scaler, overflow=True) and step(scaler, overflow=True)
    assert scaler.loss_scale() == 64.0
    assert step(scaler, overflow=True)
    assert scaler.loss_scale() == 32.0
    step(scaler, overflow=True)
    assert scaler.loss_scale() == 16.0


def test_a_clean_step_resets_the_hysteresis_count():
    scaler = LossScaler("dynamic", init_scale=64.0, hysteresis=2)
    step(scaler, overflow=True)
    step(scaler, overflow=False)
    assert state(scaler)[2] == 2
    step(scaler, overflow=True)
    assert scaler.loss_scale() == 64.0


def test_min_loss_scale_floors_the_backoff():
    scaler = LossScaler("dynamic", init_scale=4.0, min_loss_scale=3.0)
    step(scaler, overflow=True)
    step(scaler, overflow=True)
    assert scaler.loss_scale() == 3.0


def test_max_loss_scale_caps_the_initial_scale_and_the_growth():
    scaler = LossScaler("dynamic", init_scale=2.0**30, max_loss_scale=100.0, scale_window=1)
    assert scaler.loss_scale() == 100.0
    step(scaler, overflow=False)
    assert scaler.loss_scale() == 100.0
    step(scaler, overflow=True)
    step(scaler, overflow=False)
    assert scaler.loss_scale() == 100.0


def test_static_scale_never_changes_and_never_flags():
    scaler = LossScaler(128.0, scale_window=1)
    for overflow in (True, False, True):
        assert step(scaler, overflow) is False
        assert scaler.found_inf().item() == 0
        assert scaler.update_scale_().item() == 0
    assert scaler.loss_scale() == 128.0


def test_update_scale_underscore_returns_the_skip_decision_as_a_tensor():
    scaler = LossScaler("dynamic")
    scaler.found_inf().fill_(1)
    skip = scaler.update_scale_()
    assert skip.dtype == torch.float32 and skip.tolist() == [1.0]
    scaler.clear_overflow_state()
    assert scaler.update_scale_().tolist() == [0.0]


def test_update_scale_underscore_never_reads_the_device(monkeypatch):
    scaler = LossScaler("dynamic", scale_window=1, hysteresis=2, min_loss_scale=1.0)
    scaler.found_inf().fill_(1)

    def forbidden(*args, **kwargs):
        raise AssertionError("update_scale_ synchronised with the host")

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
            patch.setattr(torch.Tensor, name, forbidden)
        scaler.update_scale_()
        scaler.clear_overflow_state()
        scaler.update_scale_()
    assert scaler.loss_scale() == 2.0**17


# --- checkpoints -----------------------------------------------------------------------------------

def test_state_dict_round_trips_through_torch_load_weights_only_and_continues_identically():
    pattern = [False, True, True, False, False, False, True, False, False, False, False]
    original = LossScaler("dynamic", scale_window=3, hysteresis=2)
    for overflow in pattern[:5]:
        step(original, overflow)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    resumed = LossScaler("dynamic", scale_window=3, hysteresis=2)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert state(resumed) == state(original)
    for overflow in pattern[5:]:
        assert step(resumed, overflow) == step(original, overflow)
        assert state(resumed) == state(original)


def test_state_dict_holds_python_numbers_only():
    sd = LossScaler("dynamic").state_dict()
    assert {type(v) for v in sd.values()} <= {float, int, bool}


def test_apex_two_key_state_dict_loads():
    scaler = LossScaler("dynamic", hysteresis=3)
    scaler.load_state_dict({"loss_scale": 512.0, "unskipped": 7})
    assert state(scaler) == (512.0, 7, 3)


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"unskipped": 1}, "missing keys"),
        ({"loss_scale": 1.0, "unskipped": 1, "growth": 2}, "unexpected keys"),
        ({"loss_scale": "big", "unskipped": 1}, "loss_scale must be"),
        ({"loss_scale": float("inf"), "unskipped": 1}, "loss_scale must be"),
        ({"loss_scale": 1.0, "unskipped": -1}, "unskipped must be"),
        ({"loss_scale": 1.0, "unskipped": True}, "unskipped must be"),
        ({"loss_scale": 1.0, "unskipped": 1, "hysteresis_tracker": 1.5}, "hysteresis_tracker must be"),
        ({"loss_scale": 1.0, "unskipped": 1, "dynamic": False}, "saved from a static scaler"),
        ({"loss_scale": 0.0, "unskipped": 1}, "loss_scale must be"),
        ({"loss_scale": 1e-46, "unskipped": 1}, "loss_scale must be"),
        ({"loss_scale": 2.0**-30, "unskipped": 1}, "loss_scale must be"),
        ({"loss_scale": 2.0**25, "unskipped": 1}, "loss_scale must be"),
        ({"loss_scale": float("nan"), "unskipped": 1}, "loss_scale must be"),
        ({"loss_scale": 1.0, "unskipped": 2**40}, "unskipped must be"),
        ({"loss_scale": 1.0, "unskipped": 5}, "unskipped must be"),
        ({"loss_scale": 1.0, "unskipped": 1, "hysteresis_tracker": 2**40}, "hysteresis_tracker must be"),
        ({"loss_scale": 1.0, "unskipped": 1, "hysteresis_tracker": 2}, "hysteresis_tracker must be"),
    ],
)
def test_load_state_dict_rejects_bad_dicts_without_changing_state(bad, message):
    scaler = LossScaler("dynamic", scale_window=5)
    step(scaler, overflow=False)
    before = state(scaler)
    with pytest.raises(ValueError, match=message):
        scaler.load_state_dict(bad)
    assert state(scaler) == before


def test_a_counter_beyond_the_growth_interval_is_refused_with_the_remedy():
    scaler = LossScaler("dynamic", growth_interval=5)
    saved = LossScaler("dynamic", growth_interval=50)
    for _ in range(7):
        step(saved, overflow=False)
    with pytest.raises(ValueError, match="growth_interval=5; resume with the saved run's growth_interval"):
        scaler.load_state_dict(saved.state_dict())


@pytest.mark.filterwarnings("ignore:amp. the dynamic loss scale fell")
@pytest.mark.parametrize("extension", [True, False], ids=["amp_C", "fallback"])
@pytest.mark.parametrize("value", [0.1, 3.0, 2.0**-20, 6e4])
def test_unscaling_divides_by_the_fp32_scale_in_fp64_after_every_write(value, extension):
    # The scaler keeps 1/scale beside the scale; every way of changing the scale must keep it right.
    def unscaled(scaler):
        grads = [torch.tensor([1.0, 3.0, 5e-3, -7.0], dtype=torch.float16)]
        out = [torch.empty(4)]
        scaler.unscale(grads, out, None)
        scale = torch.tensor([scaler.loss_scale()], dtype=torch.float32)
        return out[0], grads[0].float() * scale.double().reciprocal().float()

    with use_extension(extension):
        scaler = LossScaler("dynamic", init_scale=value, min_loss_scale=2.0**-24, growth_interval=1)
        assert torch.equal(*unscaled(scaler))            # the initial scale
        scaler.set_scale(value * 1.5)
        assert torch.equal(*unscaled(scaler))            # a host write
        step(scaler, overflow=False)
        assert torch.equal(*unscaled(scaler))            # growth
        step(scaler, overflow=True)
        assert torch.equal(*unscaled(scaler))            # backoff
        restored = LossScaler("dynamic", min_loss_scale=2.0**-24, growth_interval=1)
        restored.load_state_dict(scaler.state_dict())
        assert torch.equal(*unscaled(restored))          # a checkpoint


def test_static_scaler_loads_apex_counters_that_grew_without_bound():
    scaler = LossScaler(128.0)
    scaler.load_state_dict({"loss_scale": 128.0, "unskipped": 10**6})
    assert state(scaler)[:2] == (128.0, 10**6)


def test_load_state_dict_rejects_a_non_dict():
    with pytest.raises(TypeError, match="expects a dict"):
        LossScaler("dynamic").load_state_dict([("loss_scale", 1.0)])


# --- unscaling -------------------------------------------------------------------------------------

def inverse(scale):
    return torch.tensor(1.0 / scale, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unscale_writes_fp32_master_grads_equal_to_the_fp32_reference(dtype):
    scaler = LossScaler("dynamic", init_scale=3000.0)
    model = grads(dtype)
    master = [torch.empty_like(g, dtype=torch.float32) for g in model]
    scaler.unscale(model, master, None)
    for g, m in zip(model, master):
        assert torch.equal(m, g.float() * inverse(3000.0))
    assert scaler.found_inf().item() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unscale_flags_non_finite_model_grads(dtype):
    scaler = LossScaler("dynamic")
    model = grads(dtype)
    model[2][6] = float("nan")
    scaler.unscale(model, [torch.empty_like(g, dtype=torch.float32) for g in model], None)
    assert scaler.found_inf().item() > 0


@pytest.mark.parametrize("override", [5.0, torch.tensor(5.0)])
def test_unscale_scale_override_is_a_scale_not_its_inverse(override):
    scaler = LossScaler("dynamic")
    model = grads(torch.float16)
    master = [torch.empty_like(g, dtype=torch.float32) for g in model]
    scaler.unscale(model, master, None, scale_override=override)
    for g, m in zip(model, master):
        assert torch.equal(m, g.float() * inverse(5.0))


def test_unscale_of_masters_with_static_scale_one_is_a_no_op():
    scaler = LossScaler(1.0)
    master = [torch.tensor([float("inf"), 2.0])]
    scaler.unscale(master, master, None, models_are_masters=True)
    assert master[0].tolist() == [float("inf"), 2.0]


def test_unscale_of_empty_lists_is_a_no_op():
    scaler = LossScaler("dynamic")
    scaler.unscale([], [], None)
    scaler.unscale_with_stashed([], [], [])
    assert scaler.found_inf().item() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unscale_with_stashed_adds_the_unscaled_grads_to_the_stash(dtype):
    scaler = LossScaler("dynamic", init_scale=3000.0)
    model = grads(dtype)
    stashed = grads(torch.float32, seed=1)
    master = [torch.empty_like(s) for s in stashed]
    scaler.unscale_with_stashed(model, stashed, master)
    for g, s, m in zip(model, stashed, master):
        assert torch.equal(m, inverse(3000.0) * g.float() + s)


def test_unscale_with_stashed_honours_the_override_triple():
    scaler = LossScaler("dynamic")
    model, stashed = grads(torch.float16), grads(torch.float32, seed=1)
    master = [torch.empty_like(s) for s in stashed]
    scaler.unscale_with_stashed(model, stashed, master, scale_override=(8.0, 2.0, 3.0))
    for g, s, m in zip(model, stashed, master):
        assert torch.equal(m, torch.tensor(3.0 / 8.0) * g.float() + torch.tensor(3.0 / 2.0) * s)


def test_unscale_with_stashed_checks_only_the_model_grads():
    scaler = LossScaler("dynamic")
    model, stashed = grads(torch.float16), grads(torch.float32, seed=1)
    stashed[0][0] = float("inf")
    scaler.unscale_with_stashed(model, stashed, [torch.empty_like(s) for s in stashed])
    assert scaler.found_inf().item() == 0
    model[0][0] = float("inf")
    scaler.unscale_with_stashed(model, stashed, [torch.empty_like(s) for s in stashed])
    assert scaler.found_inf().item() > 0


def inplace_unscale(scaler, values, dtype):
    """Unscale one grad in place, as amp does for params that are their own masters; returns it."""
    grad = torch.tensor(values, dtype=dtype)
    scaler.unscale([grad], [grad], None, models_are_masters=True)
    return grad


@pytest.mark.parametrize("dtype,big", [(torch.float16, 60000.0), (torch.float32, 1e38)])
def test_unscale_flags_finite_grads_whose_unscaled_value_overflows(dtype, big):
    scaler = LossScaler("dynamic", init_scale=0.25)
    grad = inplace_unscale(scaler, [big, 1.0], dtype)
    assert grad[0].isinf() and grad[1] == 4.0
    assert scaler.found_inf().item() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_unscale_by_a_reciprocal_above_one_keeps_finite_products_unflagged(dtype):
    scaler = LossScaler("dynamic", init_scale=0.25)
    values = [1000.0, -3.0, 0.0]
    grad = inplace_unscale(scaler, values, dtype)
    assert torch.equal(grad, torch.tensor(values, dtype=torch.float32).mul(4.0).to(dtype))
    assert scaler.found_inf().item() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_unscale_at_a_scale_of_one_or_more_makes_a_single_pass(monkeypatch, dtype):
    calls = []
    monkeypatch.setattr("amp.scaler.multi_tensor_applier", lambda op, *args: calls.append(op))
    scaler = LossScaler("dynamic", init_scale=1.0)
    for _ in range(3):
        inplace_unscale(scaler, [1.0], dtype)
        scaler.update_scale_()
    assert len(calls) == 3


def test_unscale_with_stashed_flags_unscaled_grads_that_overflow():
    scaler = LossScaler("dynamic", init_scale=0.25)
    model = [torch.tensor([20000.0, 1.0], dtype=torch.float16)]
    stashed = [torch.tensor([1.0, 1.0], dtype=torch.float16)]
    scaler.unscale_with_stashed(model, stashed, stashed)
    assert stashed[0][0].isinf() and stashed[0][1] == 5.0
    assert scaler.found_inf().item() > 0


@pytest.mark.filterwarnings("ignore:amp. the dynamic loss scale fell")
def test_products_of_a_shrunken_scale_are_flagged_after_updates_the_host_never_read():
    # The host learns the scale only from copies taken after updates; one taken at 1.0 and then
    # five back-offs must not make it believe 1/scale <= 1.
    scaler = LossScaler("dynamic", init_scale=1.0)
    for _ in range(5):
        scaler.found_inf().fill_(1)
        scaler.update_scale_()
    scaler.clear_overflow_state()
    grad = inplace_unscale(scaler, [3000.0], torch.float16)
    assert grad.isinf().all() and scaler.found_inf().item() > 0


# --- the floor ---------------------------------------------------------------------------------------

def python_rule(scale, overflow, floor, cap=2.0**24):
    """Apex's rule with hysteresis 1 and no growth in sight: halve on overflow, within [floor, cap]."""
    return min(max(scale / 2 if overflow else scale, floor), cap)


@pytest.mark.filterwarnings("ignore:amp. the dynamic loss scale fell")
def test_non_consecutive_overflows_stop_at_the_default_floor_and_keep_the_inverse_finite():
    scaler = LossScaler("dynamic")
    expected = 2.0**16
    for index in range(3000):
        overflow = index % 2 == 0
        assert step(scaler, overflow) is overflow
        expected = python_rule(expected, overflow, DEFAULT_MIN_LOSS_SCALE)
        assert scaler.loss_scale() == expected
    assert expected == 2.0**-24
    model = grads(torch.float16)
    master = [torch.empty_like(g, dtype=torch.float32) for g in model]
    scaler.unscale(model, master, None)
    for g, m in zip(model, master):
        assert torch.equal(m, g.float() * 2.0**24)
    assert scaler.found_inf().item() == 0


@pytest.mark.filterwarnings("ignore:amp. the dynamic loss scale fell")
def test_an_explicit_min_loss_scale_below_the_default_floor_is_honoured():
    scaler = LossScaler("dynamic", init_scale=2.0**-24, min_loss_scale=2.0**-30)
    for _ in range(10):
        step(scaler, overflow=True)
    assert scaler.loss_scale() == 2.0**-30


def test_a_scale_below_one_warns_once():
    scaler = LossScaler("dynamic", init_scale=4.0)
    with pytest.warns(UserWarning, match="loss scale fell to 0.5") as record:
        for _ in range(20):
            step(scaler, overflow=True)
    assert len(record) == 1


def test_a_scale_that_stays_at_or_above_one_does_not_warn(recwarn):
    scaler = LossScaler("dynamic", init_scale=4.0)
    for overflow in (True, True, False, False):
        step(scaler, overflow)
    assert scaler.loss_scale() == 1.0
    assert len(recwarn) == 0


# --- construction and accessors --------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs,argument",
    [
        ({"loss_scale": 0.0}, "loss_scale"),
        ({"loss_scale": "static"}, "loss_scale"),
        ({"loss_scale": "dynamic", "init_scale": -1.0}, "init_scale"),
        ({"loss_scale": "dynamic", "scale_factor": 1.0}, "scale_factor"),
        ({"loss_scale": "dynamic", "backoff_factor": 1.0}, "backoff_factor"),
        ({"loss_scale": "dynamic", "scale_window": 0}, "scale_window"),
        ({"loss_scale": "dynamic", "hysteresis": 0}, "hysteresis"),
        ({"loss_scale": "dynamic", "min_loss_scale": -1.0}, "min_loss_scale"),
        ({"loss_scale": "dynamic", "min_loss_scale": 8.0, "max_loss_scale": 4.0}, "min_loss_scale"),
        ({"loss_scale": "dynamic", "min_loss_scale": 0.0}, "min_loss_scale"),
        ({"loss_scale": "dynamic", "min_loss_scale": 1e-40}, "min_loss_scale"),
        ({"loss_scale": "dynamic", "max_loss_scale": 2.0**-30}, "max_loss_scale"),
        ({"loss_scale": "dynamic", "max_loss_scale": 1e39}, "max_loss_scale"),
        ({"loss_scale": 1e39}, "loss_scale"),
        ({"loss_scale": 1e-46}, "loss_scale"),
        ({"loss_scale": "dynamic", "init_scale": 1e-46}, "init_scale"),
        ({"loss_scale": "dynamic", "scale_factor": float("inf")}, "scale_factor"),
        ({"loss_scale": "dynamic", "growth_factor": 1.0}, "growth_factor"),
        ({"loss_scale": "dynamic", "growth_interval": 0}, "growth_interval"),
        ({"loss_scale": "dynamic", "growth_interval": 2**40}, "growth_interval"),
    ],
)
def test_invalid_arguments_raise_naming_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        LossScaler(**kwargs)


def test_growth_factor_and_scale_factor_are_one_option():
    with pytest.raises(TypeError, match="growth_factor and scale_factor are the same option"):
        LossScaler("dynamic", scale_factor=2.0, growth_factor=2.0)
    torch_named = LossScaler("dynamic", init_scale=8.0, growth_factor=3.0, growth_interval=2)
    apex_named = LossScaler("dynamic", 8.0, 3.0, 2)
    for scaler in (torch_named, apex_named):
        step(scaler, overflow=False)
        step(scaler, overflow=False)
        assert scaler.loss_scale() == 24.0


def test_amp_initialize_names_its_own_arguments():
    for bad, name in ((dict(growth_factor=1.0), "growth_factor"), (dict(growth_interval=0), "growth_interval"),
                      (dict(min_loss_scale=0.0), "min_loss_scale")):
        with pytest.raises(ValueError, match=name) as error:
            initialized("O2", **bad)
        assert "scale_factor" not in str(error.value) and "scale_window" not in str(error.value)


def test_initialize_passes_growth_options_to_the_scaler():
    initialized("O2", growth_factor=4.0, growth_interval=3, backoff_factor=0.125, hysteresis=2)
    scaler = _amp_state.loss_scalers[0]
    assert (scaler._growth_factor, scaler._scale_seq_len, scaler._backoff_factor, scaler._hysteresis) == (
        4.0, 3, 0.125, 2)


def test_set_scale_and_get_scale():
    scaler = LossScaler("dynamic", min_loss_scale=1.0, max_loss_scale=2.0**20)
    scaler.set_scale(2.0**10)
    assert scaler.get_scale() == 2.0**10 == scaler.loss_scale()
    model = grads(torch.float16)
    master = [torch.empty_like(g, dtype=torch.float32) for g in model]
    scaler.unscale(model, master, None)
    assert torch.equal(master[0], model[0].float() * 2.0**-10)


@pytest.mark.parametrize("bad", [0.0, -1.0, 0.5, 2.0**21, float("inf"), float("nan"), "big", True])
def test_set_scale_rejects_values_outside_the_range_and_changes_nothing(bad):
    scaler = LossScaler("dynamic", min_loss_scale=1.0, max_loss_scale=2.0**20)
    with pytest.raises(ValueError, match=r"set_scale: the scale must be a number in \[1.0, 1048576.0\]"):
        scaler.set_scale(bad)
    assert scaler.get_scale() == 2.0**16


def test_set_scale_of_a_static_scaler_rejects_a_scale_whose_inverse_is_not_finite():
    scaler = LossScaler(8.0)
    with pytest.raises(ValueError, match="set_scale"):
        scaler.set_scale(1e-40)
    scaler.set_scale(4.0)
    assert scaler.get_scale() == 4.0


def test_scale_tensor_is_a_0_dim_fp32_tensor_on_the_requested_device():
    scale = LossScaler("dynamic").scale_tensor("cpu")
    assert scale.shape == () and scale.dtype == torch.float32 and scale.item() == 2.0**16


def test_apex_private_attributes_read_and_write_the_state():
    scaler = LossScaler("dynamic")
    scaler._loss_scale = 1024.0
    scaler._unskipped = 5
    assert (scaler._loss_scale, scaler._unskipped) == (1024.0, 5)
    assert state(scaler)[:2] == (1024.0, 5)


@pytest.mark.cuda
def test_state_moves_to_the_device_of_first_use_and_unscales_cuda_grads():
    scaler = LossScaler("dynamic")
    model = [g.cuda() for g in grads(torch.float16)]
    master = [torch.empty_like(g, dtype=torch.float32) for g in model]
    scaler.unscale(model, master, None)
    assert scaler.found_inf().is_cuda and scaler.scale_tensor("cuda").is_cuda
    for g, m in zip(model, master):
        assert torch.equal(m, g.float() * inverse(2.0**16).cuda())


@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:amp. the dynamic loss scale fell")
def test_products_that_overflow_are_flagged_on_cuda():
    scaler = LossScaler("dynamic", init_scale=1.0)
    scaler.scale_tensor("cuda")
    for _ in range(3):
        scaler.found_inf().fill_(1)
        scaler.update_scale_()
    scaler.clear_overflow_state()
    grad = torch.tensor([10000.0, 1.0], dtype=torch.float16, device="cuda")
    scaler.unscale([grad], [grad], None, models_are_masters=True)
    assert grad[0].isinf() and grad[1] == 8.0 and scaler.found_inf().item() > 0
