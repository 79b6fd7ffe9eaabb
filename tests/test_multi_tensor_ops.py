"""The multi-tensor ops of amp.multi_tensor_apply against plain fp32/fp64 PyTorch references.

Everything here runs the pure-PyTorch path (``use_extension(False)``); tests/test_amp_C.py holds the
compiled kernels to the same bits.
"""
import itertools
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import amp.multi_tensor_apply as mta
from amp.multi_tensor_apply import (
    multi_tensor_applier,
    multi_tensor_axpby,
    multi_tensor_l2norm,
    multi_tensor_l2norm_mp,
    multi_tensor_scale,
    multi_tensor_unscale_l2norm,
    update_scale_hysteresis,
    use_extension,
    use_self_test,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CHUNK = 2048 * 32
# Sizes around the kernels' 65536-element chunk boundary.
STRADDLING_SIZES = [1, 555, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3]


@pytest.fixture(autouse=True)
def pytorch_path():
    with use_extension(False):
        yield


def make(sizes, dtype, seed=0, scale=100.0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * scale).to(dtype) for n in sizes]


def flag():
    return torch.zeros(1, dtype=torch.int32)


def ref_scale(x, scale, out_dtype):
    return (x.float() * torch.tensor(scale, dtype=torch.float32)).to(out_dtype)


def ref_axpby(x, y, a, b, out_dtype):
    ax = torch.tensor(a, dtype=torch.float32) * x.float()
    by = torch.tensor(b, dtype=torch.float32) * y.float()
    return (ax + by).to(out_dtype)


def assert_bitwise_equal(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    as_int = {2: torch.int16, 4: torch.int32}[actual.element_size()]
    assert torch.equal(actual.contiguous().view(as_int), expected.contiguous().view(as_int))


# --- multi_tensor_scale ----------------------------------------------------------------------------

@pytest.mark.parametrize("in_dtype,out_dtype", list(itertools.product(DTYPES, DTYPES)))
def test_scale_matches_fp32_reference_for_every_dtype_pair(in_dtype, out_dtype):
    ins = make(STRADDLING_SIZES, in_dtype)
    outs = [torch.empty_like(t, dtype=out_dtype) for t in ins]
    noop = flag()
    multi_tensor_applier(multi_tensor_scale, noop, [ins, outs], 0.1)
    for x, out in zip(ins, outs):
        assert_bitwise_equal(out, ref_scale(x, 0.1, out_dtype))
    assert noop.item() == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_in_place(dtype):
    ins = make([3, CHUNK + 1], dtype)
    expected = [ref_scale(x, 1 / 3, dtype) for x in ins]
    multi_tensor_applier(multi_tensor_scale, flag(), [ins, ins], 1 / 3)
    for out, ref in zip(ins, expected):
        assert_bitwise_equal(out, ref)


@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_flags_non_finite_input(position, bad, dtype):
    ins = make([10, CHUNK + 7, 10], dtype)
    target = ins[1]
    index = {"first": 0, "middle": target.numel() // 2, "last": target.numel() - 1}[position]
    target[index] = bad
    outs = [torch.empty_like(t, dtype=torch.float32) for t in ins]
    noop = flag()
    multi_tensor_applier(multi_tensor_scale, noop, [ins, outs], 0.5)
    assert noop.item() == 1
    for x, out in zip(ins, outs):
        torch.testing.assert_close(out, ref_scale(x, 0.5, torch.float32), equal_nan=True, rtol=0, atol=0)


def test_scale_does_not_flag_overflow_created_by_the_multiply():
    ins = [torch.full((4,), 60000.0)]
    outs = [torch.empty(4, dtype=torch.float16)]
    noop = flag()
    multi_tensor_applier(multi_tensor_scale, noop, [ins, outs], 2.0)
    assert torch.isinf(outs[0]).all()
    assert noop.item() == 0


def test_scale_never_clears_a_set_flag():
    noop = torch.ones(1, dtype=torch.float32)
    multi_tensor_applier(multi_tensor_scale, noop, [make([5], torch.float16), [torch.empty(5)]], 1.0)
    assert noop.item() == 1


@pytest.mark.parametrize("flag_dtype", [torch.int32, torch.float32])
def test_scale_accepts_int32_and_float32_flags(flag_dtype):
    ins = make([5], torch.float16)
    ins[0][2] = float("nan")
    noop = torch.zeros(1, dtype=flag_dtype)
    multi_tensor_applier(multi_tensor_scale, noop, [ins, [torch.empty(5)]], 1.0)
    assert noop.item() == 1


@pytest.mark.parametrize("scale", [0.1, 1 / 65536, 3.0, 1e-30])
def test_float_and_tensor_scale_give_the_same_bits(scale):
    ins = make([CHUNK + 5], torch.float16)
    by_float = [torch.empty(CHUNK + 5, dtype=torch.bfloat16)]
    by_tensor = [torch.empty(CHUNK + 5, dtype=torch.bfloat16)]
    multi_tensor_applier(multi_tensor_scale, flag(), [ins, by_float], scale)
    scale_tensor = torch.tensor([scale], dtype=torch.float32)
    multi_tensor_applier(multi_tensor_scale, flag(), [ins, by_tensor], scale_tensor)
    assert_bitwise_equal(by_float[0], by_tensor[0])


@pytest.mark.parametrize("where", [0, 2, 4])
def test_empty_tensors_anywhere_never_drop_work(where):
    sizes = [CHUNK + 3, 17, 2 * CHUNK + 1, 5]
    sizes.insert(where, 0)
    ins = make(sizes, torch.float16)
    outs = [torch.full_like(t, 7.0, dtype=torch.float32) for t in ins]
    multi_tensor_applier(multi_tensor_scale, flag(), [ins, outs], 0.25)
    for x, out in zip(ins, outs):
        assert_bitwise_equal(out, ref_scale(x, 0.25, torch.float32))


def test_zero_tensors_is_a_no_op():
    noop = flag()
    multi_tensor_applier(multi_tensor_scale, noop, [[], []], 0.5)
    multi_tensor_applier(multi_tensor_axpby, noop, [[], [], []], 0.5, 0.5, -1)
    total, per_tensor = multi_tensor_applier(multi_tensor_l2norm, noop, [[]], True)
    assert noop.item() == 0
    assert total.shape == (1,) and total.item() == 0 and per_tensor.shape == (0,)


def test_channels_last_tensors_are_scaled_elementwise():
    x = (torch.randn(2, 3, 5, 7) * 50).half().to(memory_format=torch.channels_last)
    out = torch.empty(2, 3, 5, 7).to(memory_format=torch.channels_last)
    multi_tensor_applier(multi_tensor_scale, flag(), [[x], [out]], 0.3)
    assert_bitwise_equal(out.contiguous(), ref_scale(x, 0.3, torch.float32).contiguous())


def test_a_flat_buffer_pairs_with_a_contiguous_tensor_of_another_shape():
    x = (torch.randn(4, 6) * 50).half()
    out = torch.empty(24)
    multi_tensor_applier(multi_tensor_scale, flag(), [[x], [out]], 2.0)
    assert_bitwise_equal(out, ref_scale(x.reshape(-1), 2.0, torch.float32))


def test_a_flat_buffer_and_a_transposed_tensor_are_refused():
    # The ops pair elements in memory order, and a transposed matrix stores them column by column.
    x = torch.randn(6, 4).half().t()
    out = torch.zeros(24)
    with pytest.raises(ValueError, match=r"tensor_lists\[1\]\[0\] \(out\) stores its elements in another order"):
        multi_tensor_applier(multi_tensor_scale, flag(), [[x], [out]], 2.0)
    assert not out.any()


def test_scale_does_not_record_autograd_history_for_parameters():
    master = torch.nn.Parameter(torch.randn(8))
    model = torch.empty(8, dtype=torch.float16)
    multi_tensor_applier(multi_tensor_scale, flag(), [[master], [model]], 1.0)
    assert_bitwise_equal(model, master.detach().half())


# --- multi_tensor_axpby ----------------------------------------------------------------------------

@pytest.mark.parametrize("x_dtype,y_dtype,out_dtype", list(itertools.product(DTYPES, DTYPES, DTYPES)))
def test_axpby_matches_fp32_reference_for_every_dtype_triple(x_dtype, y_dtype, out_dtype):
    sizes = [1, 555, CHUNK + 1]
    xs, ys = make(sizes, x_dtype, seed=1), make(sizes, y_dtype, seed=2)
    outs = [torch.empty_like(t, dtype=out_dtype) for t in xs]
    multi_tensor_applier(multi_tensor_axpby, flag(), [xs, ys, outs], 0.1, 0.7, -1)
    for x, y, out in zip(xs, ys, outs):
        assert_bitwise_equal(out, ref_axpby(x, y, 0.1, 0.7, out_dtype))


@pytest.mark.parametrize("alias", ["x", "y"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_axpby_writes_in_place_over_either_input(alias, dtype):
    xs, ys = make([7, CHUNK + 2], dtype, seed=3), make([7, CHUNK + 2], dtype, seed=4)
    expected = [ref_axpby(x, y, 1 / 3, -2.5, dtype) for x, y in zip(xs, ys)]
    outs = xs if alias == "x" else ys
    multi_tensor_applier(multi_tensor_axpby, flag(), [xs, ys, outs], 1 / 3, -2.5, 0)
    for out, ref in zip(outs, expected):
        assert_bitwise_equal(out, ref)


@pytest.mark.parametrize(
    "arg_to_check,bad_in,flagged",
    [(-1, "x", True), (-1, "y", True), (0, "x", True), (0, "y", False),
     (1, "x", False), (1, "y", True), (2, "x", False), (2, "y", False)],
)
def test_axpby_flags_only_the_checked_inputs(arg_to_check, bad_in, flagged):
    xs, ys = make([4, 9], torch.float16), make([4, 9], torch.float32)
    (xs if bad_in == "x" else ys)[1][8] = float("inf")
    noop = flag()
    outs = [torch.empty(4), torch.empty(9)]
    multi_tensor_applier(multi_tensor_axpby, noop, [xs, ys, outs], 1.0, 1.0, arg_to_check)
    assert noop.item() == int(flagged)


def test_axpby_float_and_tensor_coefficients_give_the_same_bits():
    xs, ys = make([CHUNK + 9], torch.bfloat16), make([CHUNK + 9], torch.float16)
    by_float = [torch.empty(CHUNK + 9, dtype=torch.float16)]
    by_tensor = [torch.empty(CHUNK + 9, dtype=torch.float16)]
    multi_tensor_applier(multi_tensor_axpby, flag(), [xs, ys, by_float], 0.3, 1 / 7, 0)
    a, b = torch.tensor([0.3]), torch.tensor([1 / 7])
    multi_tensor_applier(multi_tensor_axpby, flag(), [xs, ys, by_tensor], a, b, 0)
    assert_bitwise_equal(by_float[0], by_tensor[0])


# --- l2 norms --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm_matches_fp64_reference(dtype):
    xs = make(STRADDLING_SIZES + [0], dtype, scale=3.0)
    noop = flag()
    total, per_tensor = multi_tensor_applier(multi_tensor_l2norm, noop, [xs], True)
    expected_per = torch.stack([x.double().norm() for x in xs])
    assert total.dtype == per_tensor.dtype == torch.float32
    assert total.shape == (1,) and per_tensor.shape == (len(xs),)
    torch.testing.assert_close(per_tensor.double(), expected_per, rtol=1e-5, atol=0)
    torch.testing.assert_close(total.double(), expected_per.norm().reshape(1), rtol=1e-5, atol=0)
    assert noop.item() == 0


def test_l2norm_without_per_tensor_returns_an_empty_second_result():
    total, per_tensor = multi_tensor_applier(multi_tensor_l2norm, flag(), [make([3, 4], torch.float16)])
    assert total.shape == (1,) and per_tensor.shape == (0,)


def test_l2norm_flags_non_finite_values():
    xs = make([5, 6], torch.bfloat16)
    xs[1][5] = float("nan")
    noop = flag()
    multi_tensor_applier(multi_tensor_l2norm, noop, [xs])
    assert noop.item() == 1


def test_l2norm_mp_returns_zeros_when_the_flag_is_already_set():
    noop = torch.ones(1, dtype=torch.int32)
    xs = make([5, 6], torch.float16)
    total, per_tensor = multi_tensor_applier(multi_tensor_l2norm_mp, noop, [xs], True)
    assert total.tolist() == [0.0] and per_tensor.tolist() == [0.0, 0.0]


def test_l2norm_mp_equals_l2norm_when_the_flag_is_clear():
    xs = make([CHUNK + 1, 3], torch.float16)
    expected = multi_tensor_applier(multi_tensor_l2norm, flag(), [xs], True)
    actual = multi_tensor_applier(multi_tensor_l2norm_mp, flag(), [xs], True)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unscale_l2norm_is_the_norm_of_the_unscaled_values_and_leaves_x_alone(dtype):
    xs = make([CHUNK + 1, 10], dtype)
    before = [x.clone() for x in xs]
    inv_scale = torch.tensor([1 / 1024], dtype=torch.float32)
    total, per_tensor = multi_tensor_applier(multi_tensor_unscale_l2norm, flag(), [xs], inv_scale, True)
    expected = torch.stack([(x.double() / 1024).norm() for x in before])
    torch.testing.assert_close(per_tensor.double(), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(total.double(), expected.norm().reshape(1), rtol=1e-5, atol=0)
    for x, b in zip(xs, before):
        assert_bitwise_equal(x, b)


# --- update_scale_hysteresis -----------------------------------------------------------------------

def python_hysteresis_update(state, found_inf, growth_factor, backoff_factor, growth_interval, hysteresis):
    """The reference's section 9.6, step by step on Python numbers."""
    scale, growth, hyst = state
    if found_inf:
        hyst -= 1
        if hyst > 0:
            return scale, 0, hyst
        return float(torch.tensor(scale, dtype=torch.float64).mul(backoff_factor).float()), 0, hyst
    successful = growth + 1
    if successful == growth_interval:
        grown = float(torch.tensor(scale, dtype=torch.float64).mul(growth_factor).float())
        return (grown if grown != float("inf") else scale), 0, hysteresis
    return scale, successful, hysteresis


@settings(max_examples=40, deadline=None)
@given(
    found=st.lists(st.booleans(), min_size=1, max_size=40),
    hysteresis=st.integers(1, 4),
    growth_interval=st.integers(1, 5),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.3]),
)
def test_update_scale_hysteresis_follows_the_reference_rule(found, hysteresis, growth_interval,
                                                            backoff_factor):
    scale = torch.tensor([2.0**120])
    growth = torch.zeros(1, dtype=torch.int32)
    hyst = torch.full((1,), hysteresis, dtype=torch.int32)
    expected = (2.0**120, 0, hysteresis)
    for overflow in found:
        found_inf = torch.tensor([float(overflow)])
        rule = (3.0, backoff_factor, growth_interval, hysteresis)
        returned = update_scale_hysteresis(scale, growth, hyst, found_inf, *rule)
        expected = python_hysteresis_update(expected, overflow, *rule)
        assert returned is scale
        assert (scale.item(), growth.item(), hyst.item()) == expected


def test_update_scale_hysteresis_rejects_a_float_growth_tracker():
    with pytest.raises(ValueError, match="growth_tracker must be a 1-element torch.int32"):
        update_scale_hysteresis(torch.ones(1), torch.zeros(1), torch.ones(1, dtype=torch.int32),
                                torch.zeros(1), 2.0, 0.5, 10, 1)


# --- fuzz ------------------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.sampled_from(STRADDLING_SIZES[:3] + [0, 2, 31]), min_size=1, max_size=60),
    in_dtype=st.sampled_from(DTYPES),
    out_dtype=st.sampled_from(DTYPES),
    scale=st.floats(1e-6, 1e6),
    bad=st.none() | st.tuples(st.integers(0, 59), st.sampled_from([float("inf"), float("nan")])),
    seed=st.integers(0, 2**16),
)
def test_scale_fuzz_matches_reference(sizes, in_dtype, out_dtype, scale, bad, seed):
    ins = make(sizes, in_dtype, seed=seed)
    poisoned = bad is not None and bad[0] < len(ins) and ins[bad[0]].numel() > 0
    if poisoned:
        ins[bad[0]][-1] = bad[1]
    outs = [torch.empty_like(t, dtype=out_dtype) for t in ins]
    noop = flag()
    multi_tensor_applier(multi_tensor_scale, noop, [ins, outs], scale)
    assert noop.item() == int(poisoned)
    for x, out in zip(ins, outs):
        torch.testing.assert_close(out, ref_scale(x, scale, out_dtype), equal_nan=True, rtol=0, atol=0)


# --- bad input -------------------------------------------------------------------------------------

def test_mixed_dtypes_in_one_list_are_an_error_naming_the_tensor():
    ins = [torch.zeros(3, dtype=torch.float16), torch.zeros(3, dtype=torch.float32)]
    with pytest.raises(ValueError, match=r"tensor_lists\[0\]\[1\].*group the tensors by dtype"):
        multi_tensor_applier(multi_tensor_scale, flag(), [ins, [torch.zeros(3), torch.zeros(3)]], 1.0)


def test_mismatched_list_lengths_are_an_error():
    with pytest.raises(ValueError, match=r"lengths \[2, 1\]"):
        multi_tensor_applier(multi_tensor_scale, flag(), [[torch.zeros(3)] * 2, [torch.zeros(3)]], 1.0)


def test_mismatched_numels_are_an_error_naming_the_tensor():
    with pytest.raises(ValueError, match=r"tensor_lists\[1\]\[0\] \(out\) has 4 elements"):
        multi_tensor_applier(multi_tensor_scale, flag(), [[torch.zeros(3)], [torch.zeros(4)]], 1.0)


def test_mixed_devices_are_an_error_naming_the_tensor():
    ins = [torch.zeros(3), torch.zeros(3, device="meta")]
    with pytest.raises(ValueError, match=r"tensor_lists\[0\]\[1\].*group the tensors by device"):
        multi_tensor_applier(multi_tensor_scale, flag(), [ins, [torch.zeros(3), torch.zeros(3)]], 1.0)


def test_a_strided_slice_is_an_error_suggesting_contiguous():
    with pytest.raises(ValueError, match=r"contiguous\(\)"):
        multi_tensor_applier(multi_tensor_scale, flag(), [[torch.zeros(8)[::2]], [torch.zeros(4)]], 1.0)


def test_a_float64_scale_tensor_is_an_error():
    with pytest.raises(ValueError, match="scale must be a Python number or a 1-element float32 tensor"):
        multi_tensor_applier(multi_tensor_scale, flag(), [[torch.zeros(3)], [torch.zeros(3)]],
                             torch.tensor([1.0], dtype=torch.float64))


def test_float64_tensors_are_an_error():
    with pytest.raises(ValueError, match="only float32, float16 and bfloat16"):
        ins = [torch.zeros(3, dtype=torch.float64)]
        multi_tensor_applier(multi_tensor_scale, flag(), [ins, [torch.zeros(3)]], 1.0)


@pytest.mark.parametrize("chunk_size,error", [(True, TypeError), (2.0, TypeError), (0, ValueError),
                                              (2**63, ValueError)])
def test_a_bad_chunk_size_is_an_error_naming_it(chunk_size, error):
    with pytest.raises(error, match="chunk_size"):
        multi_tensor_scale(chunk_size, flag(), [[torch.ones(3)], [torch.empty(3)]], 1.0)


def test_an_output_partially_overlapping_an_input_is_refused_before_writing():
    base = torch.arange(10.0)
    with pytest.raises(ValueError, match=r"tensor_lists\[1\]\[0\] overlaps tensor_lists\[0\]\[0\]"):
        multi_tensor_applier(multi_tensor_scale, flag(), [[base[:8]], [base[2:]]], 2.0)
    assert torch.equal(base, torch.arange(10.0))


def test_an_inference_tensor_output_is_refused_before_writing():
    with torch.inference_mode():
        out = torch.zeros(3)
    with pytest.raises(RuntimeError, match="inference tensor"):
        multi_tensor_applier(multi_tensor_scale, flag(), [[torch.ones(3)], [out]], 1.0)
    assert out.tolist() == [0.0, 0.0, 0.0]


def test_update_scale_hysteresis_refuses_a_growth_interval_beyond_int32():
    scale = torch.ones(1)
    with pytest.raises(ValueError, match="growth_interval must fit in int32"):
        update_scale_hysteresis(scale, torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                torch.zeros(1), 2.0, 0.5, 2**32 + 1, 1)


# --- dispatch --------------------------------------------------------------------------------------

def fake_amp_C(cuda):
    # Its op does nothing, so amp's first-use self-test would reject it: the tests that call it
    # turn the self-test off.
    calls = []
    module = types.SimpleNamespace(
        multi_tensor_scale=lambda *args: calls.append(args),
        cuda_available=lambda: cuda,
    )
    return module, calls


def test_extension_serves_cpu_tensors_when_enabled(monkeypatch):
    module, calls = fake_amp_C(cuda=False)
    monkeypatch.setattr(mta, "amp_C", module)
    with use_extension(True), use_self_test(False):
        multi_tensor_applier(multi_tensor_scale, flag(), [[torch.zeros(2)], [torch.zeros(2)]], 1.0)
    assert len(calls) == 1 and calls[0][0] == CHUNK


def test_use_extension_false_forces_the_pytorch_path(monkeypatch):
    module, calls = fake_amp_C(cuda=False)
    monkeypatch.setattr(mta, "amp_C", module)
    out = [torch.zeros(2)]
    with use_extension(False):
        multi_tensor_applier(multi_tensor_scale, flag(), [[torch.ones(2)], out], 3.0)
    assert calls == [] and out[0].tolist() == [3.0, 3.0]


def test_extension_without_cuda_kernels_does_not_serve_cuda_tensors(monkeypatch):
    module, _ = fake_amp_C(cuda=False)
    monkeypatch.setattr(mta, "amp_C", module)
    monkeypatch.setattr(mta, "_extension_cuda", False)
    with use_extension(True), use_self_test(False):
        on_cuda = mta._implementation("multi_tensor_scale", torch.device("cuda", 0))
        assert on_cuda is mta._pytorch_ops.multi_tensor_scale
        assert mta._implementation("multi_tensor_scale", torch.device("cpu")) is module.multi_tensor_scale


def test_a_missing_extension_is_reported_once(monkeypatch, caplog):
    monkeypatch.setattr(mta, "amp_C", None)
    monkeypatch.setattr(mta, "_fallback_reported", set())
    with use_extension(True), caplog.at_level(logging.INFO, logger="amp"):
        for _ in range(3):
            multi_tensor_applier(multi_tensor_scale, flag(), [[torch.zeros(2)], [torch.zeros(2)]], 1.0)
    assert caplog.text.count("amp_C extension is not available") == 1


def test_path_for_names_amp_C_where_the_ops_call_it(monkeypatch):
    module, calls = fake_amp_C(cuda=False)
    monkeypatch.setattr(mta, "amp_C", module)
    with use_extension(True), use_self_test(False):
        assert mta.path_for("multi_tensor_scale", "cpu") == ("amp_C", "amp_C serves cpu tensors")
        multi_tensor_applier(multi_tensor_scale, flag(), [[torch.zeros(2)], [torch.zeros(2)]], 1.0)
    assert len(calls) == 1


@pytest.mark.parametrize("env", ["1", "0"])
def test_path_for_names_the_switch_that_turned_amp_C_off(monkeypatch, env):
    monkeypatch.setattr(mta, "amp_C", fake_amp_C(cuda=False)[0])
    monkeypatch.setenv("AMP_DISABLE_EXTENSION", env)
    with use_extension(False):
        path, reason = mta.path_for("multi_tensor_scale", torch.device("cpu"))
    switch = "AMP_DISABLE_EXTENSION=1" if env == "1" else "use_extension(False)"
    assert path == "torch" and reason == f"switched off by {switch}"


def test_path_for_gives_the_fallback_s_reasons(monkeypatch):
    module, _ = fake_amp_C(cuda=False)
    monkeypatch.setattr(mta, "amp_C", module)
    monkeypatch.setattr(mta, "_extension_cuda", False)
    with use_extension(True), use_self_test(False):
        assert mta.path_for("multi_tensor_scale", "cuda:0") == ("torch", "amp_C was built without CUDA kernels")
        assert mta.path_for("multi_tensor_scale", "meta") == ("torch", "amp_C has no kernels for meta tensors")
        # The fake module exports only multi_tensor_scale, as an amp_C built before an op existed.
        path, reason = mta.path_for("multi_tensor_adam", "cpu")
        assert path == "torch" and "has no multi_tensor_adam" in reason
        assert mta._implementation("multi_tensor_adam", torch.device("cpu")) is mta._pytorch_ops.multi_tensor_adam
        monkeypatch.setattr(mta, "amp_C", None)
        path, reason = mta.path_for("multi_tensor_scale", "cpu")
        assert path == "torch" and "amp_C extension is not available" in reason
    with pytest.raises(AttributeError):
        mta.path_for("multi_tensor_nothing", "cpu")


APEX_AMP_C = """
def multi_tensor_scale(*args):
    raise AssertionError("amp called NVIDIA Apex's amp_C")
"""
USES_APEX_AMP_C = """
import torch, amp
from amp import multi_tensor_apply as mta
assert mta.amp_C is None and not mta.multi_tensor_applier.available
print(mta.path_for("multi_tensor_scale", "cpu")[1])
model = torch.nn.Linear(3, 2)
model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                                  verbosity=0)
with amp.scale_loss(model(torch.ones(4, 3)).float().sum(), optimizer) as scaled_loss:
    scaled_loss.backward()
optimizer.step()
"""


@pytest.mark.slow
def test_an_amp_C_that_is_not_amps_is_not_called(tmp_path):
    # NVIDIA Apex installs a module named amp_C whose ops lack amp's arguments; amp must not use it.
    (tmp_path / "amp_C.py").write_text(APEX_AMP_C)
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(root)]))
    env.pop("AMP_DISABLE_EXTENSION", None)
    result = subprocess.run([sys.executable, "-c", USES_APEX_AMP_C], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "is not amp's" in result.stdout and str(tmp_path / "amp_C.py") in result.stdout


def test_check_avail_explains_how_to_build_the_extension(monkeypatch):
    monkeypatch.setattr(mta.MultiTensorApply, "available", False)
    # From the sdist of an installed amp-torch, and in a checkout.
    with pytest.raises(RuntimeError, match=r"AMP_CUDA_EXT=1 .*--no-cache-dir --no-binary amp-torch amp-torch "
                       r"\(in a checkout: AMP_CUDA_EXT=1 pip install --no-build-isolation \.\)"):
        multi_tensor_applier.check_avail()


# --- one overflow rule for the l2norm family (issue 17, item 7) -------------------------------------

# Sums of squares around fp32's limit (FLT_MAX ~ 3.4e38) with norms that all fit in fp32:
# 4 x 1e19 sums to 4e38 (overflows), 3 x 1e19 to 3e38 (fits), 1e20 squares to 1e40 alone.
OVERFLOWING_SUMS = [[1e19] * 4, [1e20, 1.0], [1e19, 1e19, 1e19, 1e19, 1e19, 1e19]]


@pytest.mark.parametrize("values", OVERFLOWING_SUMS, ids=str)
@pytest.mark.parametrize("norm", ["l2norm", "l2norm_mp", "unscale_l2norm"])
def test_l2norm_of_a_sum_of_squares_beyond_fp32_is_inf_and_flagged(values, norm):
    # Apex's CUDA kernel accumulates in fp32: the total is inf and the flag set, although the norm
    # itself would fit in fp32.
    x = torch.tensor(values, dtype=torch.float32)
    noop = flag()
    if norm == "unscale_l2norm":
        total, per_tensor = multi_tensor_unscale_l2norm(CHUNK, noop, [[x]], 1.0, True)
    else:
        op = multi_tensor_l2norm if norm == "l2norm" else multi_tensor_l2norm_mp
        total, per_tensor = op(CHUNK, noop, [[x]], True)
    assert x.double().norm().item() < torch.finfo(torch.float32).max
    assert total.isinf().item() and per_tensor.isinf().item() and noop.item() == 1


def test_l2norm_total_beyond_fp32_is_inf_while_each_tensor_norm_fits():
    xs = [torch.tensor([1e19, 1e19]), torch.tensor([1e19, 1e19])]  # 2e38 each, 4e38 together
    noop = flag()
    total, per_tensor = multi_tensor_l2norm(CHUNK, noop, [xs], True)
    assert total.isinf().item() and noop.item() == 1
    torch.testing.assert_close(per_tensor, torch.tensor([2.0**0.5 * 1e19] * 2))


def test_l2norm_of_a_sum_of_squares_just_within_fp32_is_finite():
    x = torch.tensor([1e19, 1e19, 1e19])  # 3e38 < FLT_MAX
    noop = flag()
    total, _ = multi_tensor_l2norm(CHUNK, noop, [[x]])
    torch.testing.assert_close(total, torch.tensor([3.0**0.5 * 1e19]))
    assert noop.item() == 0
