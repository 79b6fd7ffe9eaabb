"""amp.scaler.LossScaler: the dynamic-scaling rule, hysteresis, clamps, checkpoints and unscaling."""
import io

import pytest
import torch

from amp.multi_tensor_apply import use_extension
from amp.scaler import LossScaler


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
    ],
)
def test_load_state_dict_rejects_bad_dicts_without_changing_state(bad, message):
    scaler = LossScaler("dynamic", scale_window=5)
    step(scaler, overflow=False)
    before = state(scaler)
    with pytest.raises(ValueError, match=message):
        scaler.load_state_dict(bad)
    assert state(scaler) == before


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
    ],
)
def test_invalid_arguments_raise_naming_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        LossScaler(**kwargs)


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
