"""The compiled amp_C kernels against an fp64 reference and against the pure-torch fallback.

scale, axpby and update_scale_hysteresis must give the fallback's bits; the l2norm family agrees
within a tight tolerance (different summation order). CPU always; the same fuzz runs on CUDA
(``-m cuda``) where a GPU is present.
"""
import itertools
import os
import platform
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

amp_C = pytest.importorskip(
    "amp_C", reason="amp_C is not built (AMP_CPP_EXT=1 pip install --no-build-isolation .)"
)
from amp import _pytorch_ops as _torch_ops  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CHUNK = 1024  # small, so that many tensors straddle chunks while the test stays fast
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.cuda))


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param == "cuda" and not amp_C.cuda_available():
        pytest.fail("a GPU is present but amp_C was built without CUDA support (AMP_CUDA_EXT=1)")
    return request.param


def sizes(rng, n_tensors):
    """Sizes straddling the chunk, with empty tensors first, in the middle and last."""
    pool = [1, 3, 8, 17, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, 2 * CHUNK]
    out = [rng.choice(pool) for _ in range(n_tensors)]
    for i in {0, n_tensors // 2, n_tensors - 1}:
        out[i] = 0
    return out


def make(shape_list, dtype, device, gen, scale=1.0):
    return [(torch.randn(n, generator=gen) * scale).to(dtype=dtype, device=device) for n in shape_list]


def same_bits(a, b):
    """Equal values, NaN positions equal (NaN payloads may differ)."""
    return a.dtype == b.dtype and torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
        torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)
    )


def poison(tensors, where, value):
    """Write `value` into the first, a middle or the last non-empty tensor."""
    non_empty = [t for t in tensors if t.numel() > 0]
    target = {"first": non_empty[0], "middle": non_empty[len(non_empty) // 2], "last": non_empty[-1]}[where]
    target.view(-1)[target.numel() // 2] = value


def flags(device):
    return torch.zeros(1, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32, device=device)


# ---- multi_tensor_scale --------------------------------------------------------------------------


@pytest.mark.parametrize("in_dtype,out_dtype", list(itertools.product(DTYPES, DTYPES)))
def test_scale_matches_reference_and_fallback_bitwise(device, in_dtype, out_dtype):
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    for n_tensors in (1, 7, 200):
        shapes = sizes(rng, n_tensors)
        xs = make(shapes, in_dtype, device, gen, scale=100.0)
        ours, theirs = make(shapes, out_dtype, device, gen), make(shapes, out_dtype, device, gen)
        flag, ref_flag = flags(device)
        scale = 1.0 / 1024.0 + 1e-3
        amp_C.multi_tensor_scale(CHUNK, flag, [xs, ours], scale)
        _torch_ops.multi_tensor_scale(CHUNK, ref_flag, [xs, theirs], scale)
        fp32_scale = torch.tensor(scale, dtype=torch.float32).double()
        for x, o, t in zip(xs, ours, theirs):
            # fp64 holds the exact fp32 product; rounding it to fp32 then to out is the contract.
            expected = (x.double() * fp32_scale).float().to(out_dtype)
            assert same_bits(o, expected)
            assert same_bits(o, t)
        assert flag.item() == 0 and ref_flag.item() == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_in_place(device, dtype):
    gen = torch.Generator().manual_seed(1)
    xs = make([5, CHUNK + 3, 0, 4 * CHUNK], dtype, device, gen)
    expected = [(x.float() * 0.5).to(dtype) for x in xs]
    flag, _ = flags(device)
    amp_C.multi_tensor_scale(CHUNK, flag, [xs, xs], 0.5)
    assert all(same_bits(x, e) for x, e in zip(xs, expected))


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_scale_flags_non_finite_input(device, in_dtype, where, value):
    rng, gen = random.Random(2), torch.Generator().manual_seed(2)
    shapes = sizes(rng, 9)
    xs = make(shapes, in_dtype, device, gen)
    poison(xs, where, value)
    ours, theirs = make(shapes, torch.float32, device, gen), make(shapes, torch.float32, device, gen)
    flag, ref_flag = flags(device)
    amp_C.multi_tensor_scale(CHUNK, flag, [xs, ours], 0.25)
    _torch_ops.multi_tensor_scale(CHUNK, ref_flag, [xs, theirs], 0.25)
    assert flag.item() == 1 and ref_flag.item() == 1
    assert all(same_bits(o, t) for o, t in zip(ours, theirs))


def test_scale_does_not_flag_overflow_created_by_the_multiply(device):
    xs = [torch.full((10,), 60000.0, device=device)]
    out = [torch.empty(10, dtype=torch.float16, device=device)]
    flag, _ = flags(device)
    amp_C.multi_tensor_scale(CHUNK, flag, [xs, out], 4.0)
    assert flag.item() == 0 and torch.isinf(out[0]).all()


def test_scale_accepts_a_device_tensor_scale(device):
    gen = torch.Generator().manual_seed(3)
    xs = make([CHUNK + 1, 0, 33], torch.float16, device, gen)
    by_float, by_tensor = make([CHUNK + 1, 0, 33], torch.float32, device, gen), make([CHUNK + 1, 0, 33], torch.float32, device, gen)
    flag, _ = flags(device)
    amp_C.multi_tensor_scale(CHUNK, flag, [xs, by_float], 0.125)
    amp_C.multi_tensor_scale(CHUNK, flag, [xs, by_tensor], torch.tensor([0.125], device=device))
    assert all(same_bits(a, b) for a, b in zip(by_float, by_tensor))


def test_scale_sets_a_float32_flag(device):
    xs = [torch.tensor([1.0, float("nan")], device=device)]
    flag = torch.zeros(1, device=device)
    amp_C.multi_tensor_scale(CHUNK, flag, [xs, [torch.empty(2, device=device)]], 1.0)
    assert flag.item() == 1.0


def test_scale_with_the_default_chunk_straddles_it(device):
    gen = torch.Generator().manual_seed(4)
    shapes = [65535, 65536, 65537, 0]
    xs = make(shapes, torch.bfloat16, device, gen)
    ours = make(shapes, torch.float32, device, gen)
    flag, _ = flags(device)
    amp_C.multi_tensor_scale(65536, flag, [xs, ours], 3.0)
    assert all(same_bits(o, x.float() * 3.0) for o, x in zip(ours, xs))


def test_scale_pairs_channels_last_tensors_like_the_fallback(device):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 5, 7, generator=gen).to(device=device, dtype=torch.float16)
    x = x.contiguous(memory_format=torch.channels_last)
    ours = torch.empty_like(x, dtype=torch.float32)
    theirs = torch.empty_like(x, dtype=torch.float32)
    flag, ref_flag = flags(device)
    amp_C.multi_tensor_scale(CHUNK, flag, [[x], [ours]], 2.0)
    _torch_ops.multi_tensor_scale(CHUNK, ref_flag, [[x], [theirs]], 2.0)
    assert same_bits(ours, theirs) and same_bits(ours, x.float() * 2.0)


def test_scale_with_no_tensors_is_a_no_op(device):
    flag, _ = flags(device)
    amp_C.multi_tensor_scale(CHUNK, flag, [[], []], 2.0)
    assert flag.item() == 0


def rounding_cases(out_dtype):
    """fp32 values at the edges of rounding to `out_dtype`: exact ties between neighbours (normal and
    subnormal), one ulp either side of them, overflow to inf, subnormal results, -0, inf and NaN."""
    info = torch.finfo(out_dtype)
    # Every 97th representable non-negative value of out_dtype, and the midpoints to its successor.
    max_bits = int(torch.tensor(info.max, dtype=out_dtype).view(torch.int16))
    bits = torch.arange(0, max_bits, 97)
    lower = bits.to(torch.int16).view(out_dtype).double()
    upper = (bits + 1).to(torch.int16).view(out_dtype).double()
    ties = ((lower + upper) / 2).float()
    near = torch.cat([ties, ties.nextafter(torch.tensor(0.0)), ties.nextafter(torch.tensor(float("inf")))])
    top = info.max
    below_top = torch.tensor(max_bits - 1, dtype=torch.int16).view(out_dtype).item()
    overflow_tie = top + (top - below_top) / 2  # rounds to inf: the largest finite value is odd
    edges = torch.tensor([0.0, -0.0, float("inf"), float("nan"), info.tiny, info.tiny / 2,
                          info.smallest_normal * info.eps, info.smallest_normal * info.eps / 2,
                          top, overflow_tie, overflow_tie * (1 - 2.0**-23), 1e30, 2.0**-149],
                         dtype=torch.float32)
    values = torch.cat([near, edges])
    return torch.cat([values, -values])


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize("length", [None, 5, CHUNK + 13])
def test_scale_rounds_ties_subnormals_overflow_and_nan_like_the_fallback(device, out_dtype, scale, length):
    values = rounding_cases(out_dtype)
    values = values if length is None else values[:length]
    xs = [values.to(device)]
    ours = [torch.empty(values.shape, dtype=out_dtype, device=device)]
    theirs = [torch.empty(values.shape, dtype=out_dtype, device=device)]
    flag, ref_flag = flags(device)
    amp_C.multi_tensor_scale(CHUNK, flag, [xs, ours], scale)
    _torch_ops.multi_tensor_scale(CHUNK, ref_flag, [xs, theirs], scale)
    assert same_bits(ours[0], theirs[0])
    assert same_bits(ours[0], (values * scale).to(out_dtype).to(device))
    assert flag.item() == ref_flag.item()


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_axpby_rounds_ties_subnormals_overflow_and_nan_like_the_fallback(device, out_dtype):
    xs = [rounding_cases(out_dtype).to(device)]
    ys = [torch.full_like(xs[0], -0.0)]  # a*x + (-0) keeps every value of a*x, -0 included
    ours, theirs = [torch.empty_like(xs[0], dtype=out_dtype)], [torch.empty_like(xs[0], dtype=out_dtype)]
    flag, ref_flag = flags(device)
    amp_C.multi_tensor_axpby(CHUNK, flag, [xs, ys, ours], 1.0, 1.0, -1)
    _torch_ops.multi_tensor_axpby(CHUNK, ref_flag, [xs, ys, theirs], 1.0, 1.0, -1)
    assert same_bits(ours[0], theirs[0]) and same_bits(ours[0], xs[0].to(out_dtype))
    assert flag.item() == ref_flag.item()


# ---- multi_tensor_axpby --------------------------------------------------------------------------


@pytest.mark.parametrize("x_dtype,y_dtype,out_dtype", list(itertools.product(DTYPES, DTYPES, DTYPES)))
def test_axpby_matches_reference_and_fallback_bitwise(device, x_dtype, y_dtype, out_dtype):
    rng, gen = random.Random(6), torch.Generator().manual_seed(6)
    shapes = sizes(rng, 23)
    xs, ys = make(shapes, x_dtype, device, gen), make(shapes, y_dtype, device, gen)
    ours, theirs = make(shapes, out_dtype, device, gen), make(shapes, out_dtype, device, gen)
    flag, ref_flag = flags(device)
    a, b = 0.3, -1.7
    amp_C.multi_tensor_axpby(CHUNK, flag, [xs, ys, ours], a, b, -1)
    _torch_ops.multi_tensor_axpby(CHUNK, ref_flag, [xs, ys, theirs], a, b, -1)
    fa, fb = (torch.tensor(v, dtype=torch.float32) for v in (a, b))
    for x, y, o, t in zip(xs, ys, ours, theirs):
        # each product exact in fp64, rounded to fp32, then one fp32 add
        ax = (x.double() * fa.double()).float()
        by = (y.double() * fb.double()).float()
        assert same_bits(o, (ax + by).to(out_dtype))
        assert same_bits(o, t)
    assert flag.item() == 0 and ref_flag.item() == 0


@pytest.mark.parametrize("arg_to_check,expected", [(-1, (1, 1)), (0, (1, 0)), (1, (0, 1)), (2, (0, 0))])
def test_axpby_arg_to_check_selects_the_checked_inputs(device, arg_to_check, expected):
    gen = torch.Generator().manual_seed(7)
    for poisoned, want in zip(("x", "y"), expected):
        xs = make([CHUNK + 9, 0, 5], torch.float16, device, gen)
        ys = make([CHUNK + 9, 0, 5], torch.float32, device, gen)
        poison(xs if poisoned == "x" else ys, "last", float("inf"))
        out = make([CHUNK + 9, 0, 5], torch.float32, device, gen)
        flag, ref_flag = flags(device)
        amp_C.multi_tensor_axpby(CHUNK, flag, [xs, ys, out], 1.0, 2.0, arg_to_check)
        _torch_ops.multi_tensor_axpby(CHUNK, ref_flag, [xs, ys, [o.clone() for o in out]], 1.0, 2.0, arg_to_check)
        assert flag.item() == want == ref_flag.item()


def test_axpby_accepts_device_tensor_coefficients(device):
    gen = torch.Generator().manual_seed(8)
    xs, ys = make([100, CHUNK], torch.bfloat16, device, gen), make([100, CHUNK], torch.float32, device, gen)
    by_float, by_tensor = make([100, CHUNK], torch.float32, device, gen), make([100, CHUNK], torch.float32, device, gen)
    flag, _ = flags(device)
    amp_C.multi_tensor_axpby(CHUNK, flag, [xs, ys, by_float], 0.5, 0.25, 0)
    a, b = torch.tensor([0.5], device=device), torch.tensor([0.25], device=device)
    amp_C.multi_tensor_axpby(CHUNK, flag, [xs, ys, by_tensor], a, b, 0)
    assert all(same_bits(p, q) for p, q in zip(by_float, by_tensor))


# ---- l2norm family -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_tensor", [False, True])
def test_l2norm_matches_fp64_reference_and_fallback(device, dtype, per_tensor):
    rng, gen = random.Random(9), torch.Generator().manual_seed(9)
    shapes = sizes(rng, 40)
    xs = make(shapes, dtype, device, gen)
    flag, ref_flag = flags(device)
    total, norms = amp_C.multi_tensor_l2norm(CHUNK, flag, [xs], per_tensor)
    ref_total, ref_norms = _torch_ops.multi_tensor_l2norm(CHUNK, ref_flag, [xs], per_tensor)
    exact = torch.stack([x.double().norm() for x in xs])
    torch.testing.assert_close(total.double(), exact.norm().reshape(1), rtol=1e-6, atol=0)
    torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=0)
    assert total.dtype == torch.float32 and total.shape == (1,)
    if per_tensor:
        torch.testing.assert_close(norms.double(), exact, rtol=1e-6, atol=0)
        torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    else:
        assert norms.shape == (0,)
    assert flag.item() == 0


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_l2norm_flags_a_non_finite_norm(device, value):
    gen = torch.Generator().manual_seed(10)
    xs = make([CHUNK * 2 + 1, 0, 7], torch.float16, device, gen)
    poison(xs, "middle", value)
    flag, _ = flags(device)
    total, _ = amp_C.multi_tensor_l2norm(CHUNK, flag, [xs])
    assert flag.item() == 1 and not torch.isfinite(total).item()


@pytest.mark.parametrize("values", [[1e19] * 4, [1e20, 1.0], [1e19] * 3, [[1e19] * 2, [1e19] * 2]],
                         ids=["sum-4e38", "square-1e40", "sum-3e38-fits", "total-only"])
@pytest.mark.parametrize("norm", ["multi_tensor_l2norm", "multi_tensor_l2norm_mp",
                                  "multi_tensor_unscale_l2norm"])
def test_l2norm_family_agrees_with_the_fallback_on_finiteness_and_flag(device, values, norm):
    # One rule on every path (Apex's CUDA one): a sum of squares beyond fp32's range gives an inf
    # norm and raises the flag, even though the norm itself would fit in fp32.
    xs = [torch.tensor(v, device=device) for v in (values if isinstance(values[0], list) else [values])]
    flag, ref_flag = flags(device)
    extra = (1.0,) if norm == "multi_tensor_unscale_l2norm" else ()
    total, norms = getattr(amp_C, norm)(CHUNK, flag, [xs], *extra, True)
    ref_total, ref_norms = getattr(_torch_ops, norm)(CHUNK, ref_flag, [xs], *extra, True)
    assert torch.equal(total.isinf(), ref_total.isinf()) and torch.equal(norms.isinf(), ref_norms.isinf())
    assert flag.item() == ref_flag.item() == int(total.isinf().item())
    assert total.isinf().item() == (sum(float(x.double().square().sum()) for x in xs) > 3.4028234663852886e38)


def test_l2norm_mp_returns_zeros_when_the_flag_is_already_set(device):
    gen = torch.Generator().manual_seed(11)
    xs = make([CHUNK + 1, 3], torch.float32, device, gen)
    flag = torch.ones(1, dtype=torch.int32, device=device)
    total, norms = amp_C.multi_tensor_l2norm_mp(CHUNK, flag, [xs], True)
    assert total.tolist() == [0.0] and norms.tolist() == [0.0, 0.0]
    flag.zero_()
    total, _ = amp_C.multi_tensor_l2norm_mp(CHUNK, flag, [xs], True)
    torch.testing.assert_close(total.double(), torch.cat(xs).double().norm().reshape(1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_unscale_l2norm_is_the_norm_of_the_unscaled_values(device, as_tensor):
    rng, gen = random.Random(12), torch.Generator().manual_seed(12)
    shapes = sizes(rng, 15)
    xs = make(shapes, torch.float16, device, gen, scale=1000.0)
    before = [x.clone() for x in xs]
    inv_scale = torch.tensor([1 / 512], device=device) if as_tensor else 1 / 512
    flag, ref_flag = flags(device)
    total, norms = amp_C.multi_tensor_unscale_l2norm(CHUNK, flag, [xs], inv_scale, True)
    ref_total, ref_norms = _torch_ops.multi_tensor_unscale_l2norm(CHUNK, ref_flag, [xs], inv_scale, True)
    exact = torch.stack([(x.double() / 512).norm() for x in xs])
    torch.testing.assert_close(norms.double(), exact, rtol=1e-6, atol=0)
    torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=0)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    assert all(torch.equal(x, b) for x, b in zip(xs, before))


def test_l2norm_is_deterministic(device):
    gen = torch.Generator().manual_seed(13)
    xs = make([50 * CHUNK + 3, 7, 9 * CHUNK], torch.float32, device, gen)
    flag, _ = flags(device)
    first = amp_C.multi_tensor_l2norm(CHUNK, flag, [xs], True)
    for _ in range(3):
        again = amp_C.multi_tensor_l2norm(CHUNK, flag, [xs], True)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


# ---- update_scale_hysteresis ---------------------------------------------------------------------


@pytest.mark.parametrize("hysteresis,growth_interval", [(1, 3), (3, 2), (2, 1)])
def test_update_scale_hysteresis_matches_the_fallback_step_by_step(device, hysteresis, growth_interval):
    rng = random.Random(14)

    def state():
        return (torch.tensor([2.0**16], device=device), torch.zeros(1, dtype=torch.int32, device=device),
                torch.tensor([hysteresis], dtype=torch.int32, device=device))

    ours, theirs = state(), state()
    for step in range(200):
        found_inf = torch.tensor([float(rng.random() < 0.4)], device=device)
        args = (found_inf, 2.0, 0.5, growth_interval, hysteresis)
        assert amp_C.update_scale_hysteresis(*ours, *args) is ours[0]
        _torch_ops.update_scale_hysteresis(*theirs, *args)
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b), f"step {step}"


# amp's scaler passes its range (any doubles, e.g. 0.1, rounded to fp32 by the clamp), 1/scale and
# the skip flag as outputs; None leaves a side unclamped, as torch.clamp_ does.
SCALE_RANGES = [(2.0**-24, 2.0**24), (0.1, 3e5), (None, 2.0**17), (2.0**14, None), (2.0**15, 2.0**15)]


@pytest.mark.parametrize("scale_range", SCALE_RANGES, ids=str)
@pytest.mark.parametrize("hysteresis,growth_interval", [(1, 2), (2, 1)])
def test_update_with_clamp_and_outputs_matches_the_fallback_step_by_step(device, scale_range, hysteresis,
                                                                        growth_interval):
    rng = random.Random(15)

    def state():
        return (torch.tensor([2.0**16], device=device), torch.zeros(1, dtype=torch.int32, device=device),
                torch.tensor([hysteresis], dtype=torch.int32, device=device),
                torch.full((1,), 7.0, device=device), torch.full((1,), 7.0, device=device))

    ours, theirs = state(), state()
    for step in range(120):
        found_inf = torch.tensor([float(rng.random() < 0.45) * rng.choice([1.0, 3.0])], device=device)
        args = (found_inf, 4.0, 0.3, growth_interval, hysteresis, *scale_range)
        amp_C.update_scale_hysteresis(*ours[:3], *args, inv_scale=ours[3], should_skip=ours[4])
        _torch_ops.update_scale_hysteresis(*theirs[:3], *args, inv_scale=theirs[3], should_skip=theirs[4])
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b), f"step {step}"
        assert ours[4].item() == float(found_inf.item() > 0)
        assert ours[3].item() == (ours[0].double().reciprocal().float()).item()


def test_the_outputs_alone_leave_apex_s_step_unclamped(device):
    state = (torch.tensor([2.0**16], device=device), torch.zeros(1, dtype=torch.int32, device=device),
             torch.ones(1, dtype=torch.int32, device=device))
    inv, skip = torch.zeros(1, device=device), torch.zeros(1, device=device)
    amp_C.update_scale_hysteresis(*state, torch.ones(1, device=device), 2.0, 2.0**-30, 10, 1,
                                  inv_scale=inv, should_skip=skip)
    assert state[0].item() == 2.0**-14 and inv.item() == 2.0**14 and skip.item() == 1.0


@pytest.mark.cuda
def test_update_with_clamp_and_outputs_on_cuda_matches_the_cpu_twin():
    rng = random.Random(16)
    cpu = [torch.tensor([2.0**16]), torch.zeros(1, dtype=torch.int32), torch.full((1,), 2, dtype=torch.int32),
           torch.zeros(1), torch.zeros(1)]
    gpu = [t.cuda() for t in cpu]
    for step in range(100):
        found_inf = float(rng.random() < 0.45)
        for tensors in (cpu, gpu):
            flag = torch.tensor([found_inf], device=tensors[0].device)
            amp_C.update_scale_hysteresis(*tensors[:3], flag, 3.0, 0.3, 2, 2, 0.1, 3e5,
                                          inv_scale=tensors[3], should_skip=tensors[4])
        assert all(torch.equal(c, g.cpu()) for c, g in zip(cpu, gpu)), f"step {step}"


def test_update_scale_hysteresis_never_grows_to_inf(device):
    scale = torch.tensor([3e38], device=device)
    growth = torch.zeros(1, dtype=torch.int32, device=device)
    hyst = torch.ones(1, dtype=torch.int32, device=device)
    amp_C.update_scale_hysteresis(scale, growth, hyst, torch.zeros(1, device=device), 2.0, 0.5, 1, 1)
    assert scale.item() == pytest.approx(3e38) and growth.item() == 0


# ---- argument checks -----------------------------------------------------------------------------


def test_mixed_dtypes_in_one_list_name_the_tensor():
    xs = [torch.ones(3), torch.ones(3, dtype=torch.float16)]
    with pytest.raises(ValueError, match=r"tensor_lists\[0\]\[1\] \(in\) has dtype torch.float16"):
        amp_C.multi_tensor_scale(CHUNK, torch.zeros(1, dtype=torch.int32), [xs, [torch.empty(3)] * 2], 1.0)


def test_mismatched_numel_is_an_error():
    with pytest.raises(ValueError, match=r"tensor_lists\[1\]\[0\] \(out\) has 4 elements"):
        amp_C.multi_tensor_scale(CHUNK, torch.zeros(1, dtype=torch.int32), [[torch.ones(3)], [torch.ones(4)]], 1.0)


def test_mismatched_list_lengths_are_an_error():
    with pytest.raises(ValueError, match="tensor_lists\\[1\\] has 0 tensors"):
        amp_C.multi_tensor_scale(CHUNK, torch.zeros(1, dtype=torch.int32), [[torch.ones(3)], []], 1.0)


def test_a_strided_view_is_refused():
    x = torch.ones(4, 4)[:, ::2]
    with pytest.raises(ValueError, match="not dense"):
        amp_C.multi_tensor_scale(CHUNK, torch.zeros(1, dtype=torch.int32), [[x], [torch.empty(2, 4)]], 1.0)


def test_unsupported_dtype_and_flag_are_errors():
    with pytest.raises(ValueError, match="dtype torch.float64"):
        amp_C.multi_tensor_l2norm(CHUNK, torch.zeros(1, dtype=torch.int32), [[torch.ones(3, dtype=torch.float64)]])
    with pytest.raises(ValueError, match="noop_flag"):
        amp_C.multi_tensor_l2norm(CHUNK, torch.zeros(2, dtype=torch.int32), [[torch.ones(3)]])


def test_cuda_availability_matches_the_build():
    assert isinstance(amp_C.cuda_available(), bool)
    if not torch.cuda.is_available():
        assert amp_C.cuda_available() is False


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            line = next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return None
    return set(line.split(":", 1)[1].split())


def test_build_info_describes_this_build():
    info = amp_C.build_info()
    assert set(info) == {"cuda_kernels", "torch_cuda", "cuda_images", "cuda_runtime", "cpu_x86_64_v3_clones",
                         "cpu_runs_x86_64_v3", "cpu_f16c_stores"}
    # setup.py records the images and the runtime linked in whenever it compiles CUDA kernels, and only then.
    assert bool(info["cuda_images"]) == info["cuda_kernels"] == (info["cuda_runtime"] is not None)
    assert info["cuda_runtime"] is None or re.fullmatch(r"\d+\.\d+", info["cuda_runtime"])
    assert all(image.startswith(("sm_", "compute_")) for image in info["cuda_images"])
    assert info["torch_cuda"] == (info["cuda_kernels"] and torch.version.cuda is not None)
    assert info["cpu_runs_x86_64_v3"] <= info["cpu_x86_64_v3_clones"]
    flags = cpu_flags()
    if flags is not None and platform.machine() == "x86_64":
        assert info["cpu_f16c_stores"] == ({"avx", "f16c"} <= flags)
        if info["cpu_runs_x86_64_v3"]:
            assert {"avx2", "fma", "f16c"} <= flags
        elif info["cpu_x86_64_v3_clones"]:
            assert not {"avx2", "fma", "f16c", "bmi2", "movbe"} <= flags


# ---- the module ----------------------------------------------------------------------------------

BARE_IMPORT = """
import sys
assert "torch" not in sys.modules
import amp_C
torch = sys.modules["torch"]
x, out = torch.tensor([1.0, 3.0]), torch.empty(2, dtype=torch.float16)
flag = torch.zeros(1, dtype=torch.int32)
amp_C.multi_tensor_scale(2048, flag, [[x], [out]], 0.5)
print(out.tolist(), flag.item())
"""


@pytest.mark.slow
def test_a_bare_import_in_a_fresh_interpreter_works(tmp_path):
    # Apex-era files start with `import amp_C`: the extension finds torch's libraries through its
    # rpath and imports torch before it converts a tensor.
    env = dict(os.environ, PYTHONPATH=str(Path(amp_C.__file__).parent))
    result = subprocess.run([sys.executable, "-c", BARE_IMPORT], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[0.5,", "1.5]", "0"]


# ---- the same contract as the fallback -----------------------------------------------------------

BOTH = {"amp_C": amp_C, "fallback": _torch_ops}


def test_writes_bump_the_version_counter_of_every_written_tensor(device):
    def versions(tensors):
        return [t._version for t in tensors]

    xs, outs = [torch.ones(5, device=device)], [torch.zeros(5, device=device)]
    flag, _ = flags(device)
    before = versions(outs + [flag])
    amp_C.multi_tensor_scale(CHUNK, flag, [xs, outs], 2.0)
    assert all(a > b for a, b in zip(versions(outs + [flag]), before))

    before = versions(outs + [flag])
    amp_C.multi_tensor_axpby(CHUNK, flag, [xs, xs, outs], 2.0, 1.0, -1)
    assert all(a > b for a, b in zip(versions(outs + [flag]), before))

    before = versions([flag])
    amp_C.multi_tensor_l2norm(CHUNK, flag, [xs])
    assert versions([flag])[0] > before[0]

    state = (torch.ones(1, device=device), torch.zeros(1, dtype=torch.int32, device=device),
             torch.ones(1, dtype=torch.int32, device=device))
    before = versions(state)
    amp_C.update_scale_hysteresis(*state, torch.zeros(1, device=device), 2.0, 0.5, 10, 1)
    assert all(a > b for a, b in zip(versions(state), before))

    outputs = (torch.zeros(1, device=device), torch.zeros(1, device=device))
    before = versions(state + outputs)
    amp_C.update_scale_hysteresis(*state, torch.zeros(1, device=device), 2.0, 0.5, 10, 1, 1.0, 2.0, *outputs)
    assert all(a > b for a, b in zip(versions(state + outputs), before))


def test_autograd_sees_a_tensor_overwritten_by_a_kernel():
    x = torch.randn(6, requires_grad=True)
    y = x * 1.0
    z = y.sin()  # saves y for the backward pass
    amp_C.multi_tensor_scale(CHUNK, torch.zeros(1, dtype=torch.int32), [[torch.ones(6)], [y]], 1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


@pytest.mark.parametrize("chunk_size", [2**31 - 1, 2**31, 2**62, 2**63 - 1])
def test_huge_chunk_sizes_give_the_fallbacks_results(chunk_size):
    gen = torch.Generator().manual_seed(16)
    xs = make([1000, 0, 3], torch.float32, "cpu", gen)
    total, norms = amp_C.multi_tensor_l2norm(chunk_size, torch.zeros(1, dtype=torch.int32), [xs], True)
    ref_total, ref_norms = _torch_ops.multi_tensor_l2norm(chunk_size, torch.zeros(1, dtype=torch.int32), [xs], True)
    torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=0)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    ours = [torch.zeros_like(x, dtype=torch.float16) for x in xs]
    amp_C.multi_tensor_scale(chunk_size, torch.zeros(1, dtype=torch.int32), [xs, ours], 1.0)
    assert all(same_bits(o, x.half()) for o, x in zip(ours, xs))


def raised_by(fn):
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value)


@pytest.mark.parametrize(
    "make_lists",
    [
        pytest.param(lambda base: [[base[:8]], [base[2:]]], id="shifted-views"),
        pytest.param(lambda base: [[base[:5], base[5:]], [base[5:], torch.empty(5)]], id="other-index"),
        pytest.param(lambda base: [[torch.ones(5), base[3:8]], [base[:5], torch.empty(5)]], id="input-after-output"),
        pytest.param(lambda base: [[torch.ones(5), torch.ones(5)], [base[:5], base[:5]]], id="two-outputs"),
        pytest.param(lambda base: [[base], [base.view(torch.float16)[:10]]], id="other-dtype"),
    ],
)
def test_scale_refuses_partially_overlapping_tensors_in_both_paths(make_lists):
    results = {}
    for name, ops in BOTH.items():
        base = torch.arange(10.0)
        results[name] = raised_by(lambda: ops.multi_tensor_scale(CHUNK, torch.zeros(1, dtype=torch.int32), make_lists(base), 2.0))
        assert torch.equal(base, torch.arange(10.0)), f"{name} wrote before refusing"
    assert results["amp_C"][0] is ValueError and "overlaps" in results["amp_C"][1]
    assert results["amp_C"] == results["fallback"]


def test_axpby_refuses_an_output_overlapping_an_input_of_another_index_in_both_paths():
    results = {}
    for name, ops in BOTH.items():
        base = torch.arange(10.0)
        xs, ys, outs = [base[:5], base[5:]], [torch.ones(5), torch.ones(5)], [base[:5], base[5:]]
        ys[1] = base[:5]  # y[1] is read while out[0] is written
        results[name] = raised_by(lambda: ops.multi_tensor_axpby(CHUNK, torch.zeros(1, dtype=torch.int32), [xs, ys, outs], 1.0, 1.0, -1))
    assert results["amp_C"][0] is ValueError
    assert results["amp_C"] == results["fallback"]


@pytest.mark.parametrize("alias", ["x", "y", "both"])
def test_axpby_in_place_over_its_own_inputs_is_allowed(alias):
    x, y = torch.arange(6.0), torch.full((6,), 2.0)
    xs, ys = [x], ([x] if alias == "both" else [y])
    outs = ys if alias == "y" else xs
    expected = (2.0 * xs[0] + 3.0 * ys[0]).clone()
    amp_C.multi_tensor_axpby(CHUNK, torch.zeros(1, dtype=torch.int32), [xs, ys, outs], 2.0, 3.0, -1)
    assert torch.equal(outs[0], expected)


@pytest.mark.parametrize(
    "chunk_size,error",
    [(True, TypeError), (False, TypeError), (2.0, TypeError), (0, ValueError), (-1, ValueError),
     (2**63, ValueError), (-(2**64), ValueError)],
)
def test_a_bad_chunk_size_is_refused_alike_in_both_paths(chunk_size, error):
    for name, ops in BOTH.items():
        for call in (
            lambda: ops.multi_tensor_scale(chunk_size, torch.zeros(1, dtype=torch.int32), [[torch.ones(3)], [torch.empty(3)]], 1.0),
            lambda: ops.multi_tensor_l2norm(chunk_size, torch.zeros(1, dtype=torch.int32), [[torch.ones(3)]]),
        ):
            kind, message = raised_by(call)
            assert kind is error and "chunk_size" in message, name


@pytest.mark.parametrize("argument", ["growth_interval", "hysteresis"])
@pytest.mark.parametrize("value", [2**31, -(2**31) - 1, 2**32 + 1])
def test_hysteresis_counts_beyond_int32_are_refused_alike_in_both_paths(argument, value):
    for name, ops in BOTH.items():
        state = (torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
        counts = {"growth_interval": 1, "hysteresis": 1, argument: value}
        kind, message = raised_by(lambda: ops.update_scale_hysteresis(
            *state, torch.zeros(1), 2.0, 0.5, counts["growth_interval"], counts["hysteresis"]))
        assert kind is ValueError and argument in message, name
        assert state[0].item() == 1.0 and state[1].item() == 0 and state[2].item() == 1, name


@pytest.mark.parametrize("bad", [
    dict(min_scale=1e39), dict(max_scale=-1e39), dict(max_scale=float("nan")),
    dict(inv_scale=torch.zeros(1, dtype=torch.float64)), dict(should_skip=torch.zeros(2)),
    dict(should_skip=torch.zeros(1, dtype=torch.int32))], ids=str)
def test_bad_clamp_bounds_and_outputs_are_refused_alike_in_both_paths(bad):
    for name, ops in BOTH.items():
        state = (torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
        outputs = dict(inv_scale=torch.zeros(1), should_skip=torch.zeros(1))
        kind, message = raised_by(lambda: ops.update_scale_hysteresis(
            *state, torch.ones(1), 2.0, 0.5, 1, 1, **{**outputs, **bad}))
        assert kind is ValueError and next(iter(bad)) in message, (name, message)
        assert [t.item() for t in state] == [1.0, 0, 1], name
        assert all(t.item() == 0 for t in outputs.values()), name


def test_arg_to_check_beyond_int32_checks_nothing_like_the_fallback():
    xs, ys = [torch.tensor([float("inf"), 1.0])], [torch.ones(2)]
    for name, ops in BOTH.items():
        flag = torch.zeros(1, dtype=torch.int32)
        ops.multi_tensor_axpby(CHUNK, flag, [xs, ys, [torch.empty(2)]], 1.0, 1.0, 2**32)
        assert flag.item() == 0, name


def test_an_inference_tensor_output_is_refused_before_anything_is_written():
    with torch.inference_mode():
        out = torch.zeros(4)
    for name, ops in BOTH.items():
        kind, message = raised_by(lambda: ops.multi_tensor_scale(
            CHUNK, torch.zeros(1, dtype=torch.int32), [[torch.ones(4)], [out]], 1.0))
        assert kind is RuntimeError and "inference" in message, name
        assert out.tolist() == [0.0] * 4, name


# ---- CUDA only -----------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_matches_cpu_bitwise():
    rng, gen = random.Random(15), torch.Generator().manual_seed(15)
    shapes = sizes(rng, 60)
    xs = make(shapes, torch.float16, "cpu", gen, scale=50.0)
    cpu_out = make(shapes, torch.float32, "cpu", gen)
    cuda_out = [o.cuda() for o in cpu_out]
    amp_C.multi_tensor_scale(CHUNK, torch.zeros(1, dtype=torch.int32), [xs, cpu_out], 1 / 3)
    amp_C.multi_tensor_scale(CHUNK, torch.zeros(1, dtype=torch.int32, device="cuda"), [[x.cuda() for x in xs], cuda_out], 1 / 3)
    assert all(same_bits(c, g.cpu()) for c, g in zip(cpu_out, cuda_out))


@pytest.mark.cuda
def test_cuda_tensor_over_2_31_elements():
    n = 2**31 + 4099
    free, _ = torch.cuda.mem_get_info()
    if free < n * 2 * 2 + (1 << 30):
        pytest.fail(f"needs {n * 4 / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} available")
    x = torch.ones(n, dtype=torch.float16, device="cuda")
    x[-1] = 3.0
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    amp_C.multi_tensor_scale(65536, flag, [[x], [x]], 2.0)
    assert x[-1].item() == 6.0 and x[0].item() == 2.0 and x[2**31].item() == 2.0
    total, _ = amp_C.multi_tensor_l2norm(65536, flag, [[x[: 2**31 + 1]]])
    assert total.item() == pytest.approx(2.0 * (2**31 + 1) ** 0.5, rel=1e-4)
    assert flag.item() == 0
