"""The fused optimizer ops multi_tensor_sgd / multi_tensor_adam on every path.

Each test runs the pure-PyTorch fallback, the CPU twin of amp_C (where it is built) and, under
``-m cuda``, the CUDA kernel. References are torch.optim's SGD / Adam / AdamW (``foreach=False``)
run on fp32 copies of the same data: the ops follow their fp32 arithmetic (fused multiply-adds
included), so both are compared bit for bit, Adam's reference stepping with the correctly rounded
square root that the kernels take (torch's CPU sqrt is not correctly rounded on every build).
"""
import itertools
import math
import random
import struct
from fractions import Fraction

import pytest
import torch

from amp import _pytorch_ops as _torch_ops
from amp._pytorch_ops import exact
from amp.multi_tensor_apply import amp_C, multi_tensor_adam, multi_tensor_sgd, use_extension
from amp_common import correctly_rounded_sqrt

CHUNK = 1024  # small, so that tensors straddle chunks while the tests stay fast
LOW = (torch.float16, torch.bfloat16)
PATHS = (
    "fallback",
    pytest.param("amp_C", marks=pytest.mark.skipif(amp_C is None, reason="amp_C is not built")),
    pytest.param("cuda", marks=pytest.mark.cuda),
)


@pytest.fixture(params=PATHS)
def path(request):
    """(device, whether amp_C serves it), with the choice made for the whole test."""
    device = "cuda" if request.param == "cuda" else "cpu"
    if request.param == "cuda" and (amp_C is None or not amp_C.cuda_available()):
        pytest.fail("a GPU is present but amp_C was built without CUDA support (AMP_CUDA_EXT=1)")
    with use_extension(request.param != "fallback"):
        yield device


def randn(sizes, dtype, device, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * scale).to(dtype=dtype, device=device) for n in sizes]


def same_bits(a, b):
    """Equal values and equal NaN positions (NaN payloads may differ)."""
    return a.dtype == b.dtype and torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
        torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))


def flag(device, value=0):
    return torch.full((1,), value, dtype=torch.int32, device=device)


def torch_optim_reference(make_optimizer, params, grads_per_step):
    """fp32 copies of ``params`` after torch.optim steps with the given fp32 grads, and its state."""
    ref = [p.detach().float().clone().requires_grad_() for p in params]
    opt = make_optimizer(ref)
    for grads in grads_per_step:
        for p, g in zip(ref, grads):
            p.grad = g.float().clone()
        with correctly_rounded_sqrt():
            opt.step()
    return [p.detach() for p in ref], [opt.state[p] for p in ref]


SIZES = [3, CHUNK - 1, CHUNK + 1, 0, 2 * CHUNK + 5]
SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-2),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
]


def sgd_step(lists, case, first_run, scale=1.0, noop=None, device="cpu"):
    multi_tensor_sgd(CHUNK, flag(device) if noop is None else noop, lists,
                     case.get("weight_decay", 0.0), case.get("momentum", 0.0),
                     case.get("dampening", 0.0), case["lr"], case.get("nesterov", False),
                     first_run, False, scale)


@pytest.mark.parametrize("case", SGD_CASES, ids=str)
def test_sgd_matches_torch_optim_sgd_bitwise(path, case):
    weights = randn(SIZES, torch.float32, path, seed=1)
    grads_per_step = [randn(SIZES, torch.float32, path, seed=10 + s) for s in range(4)]
    expected, state = torch_optim_reference(
        lambda ps: torch.optim.SGD(ps, foreach=False, **case), weights, grads_per_step)
    bufs = [torch.zeros_like(w) for w in weights]
    for s, grads in enumerate(grads_per_step):
        sgd_step([grads, weights, bufs], case, first_run=s == 0, device=path)
    for w, b, e, st in zip(weights, bufs, expected, state):
        assert same_bits(w, e)
        if case.get("momentum"):
            assert same_bits(b, st["momentum_buffer"])


ADAM_CASES = [
    (torch.optim.Adam, dict(lr=1e-3)),
    (torch.optim.Adam, dict(lr=1e-2, betas=(0.3, 0.99), weight_decay=1e-2)),
    (torch.optim.AdamW, dict(lr=1e-3, weight_decay=1e-2)),
    (torch.optim.AdamW, dict(lr=1e-2, betas=(0.0, 0.9), eps=1e-6, weight_decay=0.1)),
]


def adam_step(lists, cls, case, step, inv_scale=1.0, noop=None, device="cpu"):
    beta1, beta2 = case.get("betas", (0.9, 0.999))
    multi_tensor_adam(CHUNK, flag(device) if noop is None else noop, lists, case["lr"], beta1,
                      beta2, case.get("eps", 1e-8), step, int(cls is torch.optim.AdamW), True,
                      case.get("weight_decay", 0.0), inv_scale)


@pytest.mark.parametrize("cls,case", ADAM_CASES, ids=str)
def test_adam_matches_torch_optim_adam_and_adamw_bitwise(path, cls, case):
    params = randn(SIZES, torch.float32, path, seed=2)
    grads_per_step = [randn(SIZES, torch.float32, path, seed=20 + s) for s in range(4)]
    expected, state = torch_optim_reference(
        lambda ps: cls(ps, foreach=False, **case), params, grads_per_step)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for s, grads in enumerate(grads_per_step):
        adam_step([grads, params, m, v], cls, case, s + 1, device=path)
    for p, mi, vi, e, st in zip(params, m, v, expected, state):
        assert same_bits(p, e)
        assert same_bits(mi, st["exp_avg"]) and same_bits(vi, st["exp_avg_sq"])


@pytest.mark.parametrize("grad_dtype,copy_dtype", list(itertools.product(
    (torch.float16, torch.bfloat16, torch.float32), LOW)))
def test_sgd_master_weights_form_equals_unscale_then_torch_optim_then_copy(path, grad_dtype,
                                                                           copy_dtype):
    # The unfused amp path: master grads = fp32(grad * inv_scale), torch.optim on the fp32
    # masters, then the masters rounded into the model.
    case = dict(lr=0.1, momentum=0.9, weight_decay=1e-3)
    inv_scale = 2.0**-10
    masters = randn(SIZES, torch.float32, path, seed=3)
    grads = randn(SIZES, grad_dtype, path, seed=30, scale=1024.0)
    scale_t = torch.tensor(inv_scale, dtype=torch.float32)
    expected, _ = torch_optim_reference(lambda ps: torch.optim.SGD(ps, foreach=False, **case),
                                        masters, [[g.float() * scale_t.to(g.device) for g in grads]])
    copies = [torch.zeros_like(m, dtype=copy_dtype) for m in masters]
    bufs = [torch.zeros_like(m) for m in masters]
    sgd_step([grads, masters, bufs, copies], case, first_run=True, scale=inv_scale, device=path)
    for m, c, e in zip(masters, copies, expected):
        assert same_bits(m, e) and same_bits(c, e.to(copy_dtype))


@pytest.mark.parametrize("grad_dtype,copy_dtype", list(itertools.product(
    (torch.float16, torch.bfloat16, torch.float32), LOW)))
def test_adam_master_weights_form_equals_unscale_then_torch_optim_then_copy(path, grad_dtype,
                                                                            copy_dtype):
    case = dict(lr=1e-3, weight_decay=1e-2)
    inv_scale = torch.tensor(2.0**-12, dtype=torch.float32, device=path)  # a device tensor
    masters = randn(SIZES, torch.float32, path, seed=4)
    grads = randn(SIZES, grad_dtype, path, seed=40, scale=4096.0)
    expected, _ = torch_optim_reference(lambda ps: torch.optim.AdamW(ps, foreach=False, **case),
                                        masters, [[g.float() * inv_scale for g in grads]])
    m = [torch.zeros_like(p) for p in masters]
    v = [torch.zeros_like(p) for p in masters]
    copies = [torch.zeros_like(p, dtype=copy_dtype) for p in masters]
    adam_step([grads, masters, m, v, copies], torch.optim.AdamW, case, 1, inv_scale=inv_scale,
              device=path)
    for p, c, e in zip(masters, copies, expected):
        assert same_bits(p, e) and same_bits(c, p.to(copy_dtype))


def all_lists(form, device):
    """Tensor lists of every op and dtype form, with non-zero state."""
    grad_dtype, weight_dtype, copy_dtype = form[1:]
    sizes = SIZES
    grads = randn(sizes, grad_dtype, device, seed=5)
    weights = randn(sizes, weight_dtype, device, seed=6)
    state = [randn(sizes, weight_dtype, device, seed=7 + k) for k in range(2 if form[0] == "adam" else 1)]
    if form[0] == "adam":
        state[1] = [t.abs() for t in state[1]]
    copies = [randn(sizes, copy_dtype, device, seed=9)] if copy_dtype else []
    return [grads, weights, *state, *copies]


FORMS = (
    [("sgd", d, d, None) for d in (torch.float32, *LOW)]
    + [("sgd", g, torch.float32, c) for g in (torch.float32, *LOW) for c in LOW]
    + [("adam", d, d, None) for d in (torch.float32, *LOW)]
    + [("adam", g, torch.float32, None) for g in LOW]
    + [("adam", g, torch.float32, c) for g in (torch.float32, *LOW) for c in LOW]
)


def run_form(form, lists, noop, step=3, scale=0.5, device="cpu"):
    if form[0] == "sgd":
        sgd_step(lists, dict(lr=0.1, momentum=0.9, weight_decay=1e-2), first_run=False,
                 scale=scale, noop=noop, device=device)
    else:
        adam_step(lists, torch.optim.AdamW, dict(lr=1e-2, weight_decay=1e-2), step,
                  inv_scale=scale, noop=noop, device=device)


@pytest.mark.parametrize("form", FORMS, ids=str)
@pytest.mark.parametrize("flag_dtype", [torch.int32, torch.float32])
def test_a_set_flag_writes_nothing(path, form, flag_dtype):
    lists = all_lists(form, path)
    before = [[t.clone() for t in tensors] for tensors in lists]
    noop = torch.ones(1, dtype=flag_dtype, device=path)
    run_form(form, lists, noop, device=path)
    assert all(same_bits(t, b) for tensors, olds in zip(lists, before) for t, b in zip(tensors, olds))
    assert noop.item() == 1


def test_adam_tensor_step_and_int_step_give_the_same_bits(path):
    results = []
    for step in (7, torch.tensor([7], dtype=torch.int64, device=path),
                 torch.tensor([7.0], device=path)):
        lists = all_lists(("adam", torch.float16, torch.float32, torch.float16), path)
        run_form(("adam",), lists, flag(path), step=step, device=path)
        results.append(lists)
    for other in results[1:]:
        assert all(same_bits(a, b) for x, y in zip(results[0], other) for a, b in zip(x, y))


@pytest.mark.parametrize("op", ["sgd", "adam"])
def test_a_wrong_dtype_combination_is_refused_naming_the_lists(path, op):
    # fp16 weights with an fp16 model copy: the copy needs fp32 weights to come from.
    lists = all_lists((op, torch.float16, torch.float16, torch.float16), path)
    with pytest.raises(ValueError, match="unsupported dtype combination"):
        run_form((op,), lists, flag(path), device=path)


# ---- the compiled kernels against the fallback, bit for bit ---------------------------------------

needs_amp_C = pytest.mark.skipif(amp_C is None, reason="amp_C is not built")
KERNEL_DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.cuda))


def fuzz_lists(form, device, seed, offset):
    """Lists of ``form`` with sizes straddling CHUNK, empty tensors first, in the middle and last,
    each tensor ``offset`` elements into its own buffer (so not 16-byte aligned when odd)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [0, 1, 7, CHUNK - 1, 0, CHUNK, CHUNK + 1, 2 * CHUNK + 9, 0]
    dtypes = [form[1], form[2], *([form[2]] * (2 if form[0] == "adam" else 1))]
    dtypes += [form[3]] if form[3] else []

    def tensor(n, dtype, k):
        values = torch.randn(n + offset, generator=gen)
        if k == 3 and form[0] == "adam":
            values = values.abs()  # exp_avg_sq >= 0
        return values.to(dtype=dtype, device=device)[offset:]

    return [[tensor(n, dtype, k) for n in sizes] for k, dtype in enumerate(dtypes)]


def run_op(impl, form, lists, noop, step=5, scale=0.25, **overrides):
    if form[0] == "sgd":
        args = dict(wd=1e-2, momentum=0.9, dampening=0.1, lr=0.1, nesterov=True, first_run=False,
                    wd_after_momentum=False, scale=scale) | overrides
        impl.multi_tensor_sgd(CHUNK, noop, lists, **args)
    else:
        args = dict(lr=1e-2, beta1=0.9, beta2=0.999, epsilon=1e-8, step=step, mode=1,
                    bias_correction=True, weight_decay=1e-2, inv_scale=scale) | overrides
        impl.multi_tensor_adam(CHUNK, noop, lists, **args)


def clone_lists(lists):
    return [[t.clone() for t in tensors] for tensors in lists]


def assert_same_lists(ours, theirs):
    for k, (a_list, b_list) in enumerate(zip(ours, theirs)):
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            assert same_bits(a.cpu(), b.cpu()), f"tensor_lists[{k}][{i}] differs"


@needs_amp_C
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("form", FORMS, ids=str)
@pytest.mark.parametrize("poison", [None, ("first", float("inf")), ("middle", float("nan")),
                                    ("last", float("-inf"))], ids=str)
def test_kernel_matches_the_fallback_bitwise(device, form, poison):
    offset = 1 if poison is None else 0
    lists = fuzz_lists(form, device, seed=hash((form, str(poison))) % 1000, offset=offset)
    if poison is not None:
        where, value = poison
        grad = lists[0][7]
        grad[{"first": 0, "middle": grad.numel() // 2, "last": -1}[where]] = value
    reference = clone_lists([[t.cpu() for t in tensors] for tensors in lists])
    noop = flag(device)
    run_op(amp_C, form, lists, noop)
    run_op(_torch_ops, form, reference, flag("cpu"))
    assert_same_lists(lists, reference)
    assert noop.item() == 0  # the ops never set the flag


@needs_amp_C
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("variant", [
    dict(op="sgd", first_run=True), dict(op="sgd", momentum=0.0, wd=0.0),
    dict(op="sgd", wd_after_momentum=True, nesterov=False), dict(op="adam", mode=0),
    dict(op="adam", bias_correction=False), dict(op="adam", beta1=0.0),
    dict(op="adam", step=2**31 - 1), dict(op="adam", beta1=0.6, weight_decay=0.0),
], ids=str)
def test_kernel_matches_the_fallback_for_every_option(device, variant):
    variant = dict(variant)
    op = variant.pop("op")
    form = (op, torch.float16, torch.float32, torch.bfloat16)
    lists = fuzz_lists(form, device, seed=3, offset=0)
    reference = clone_lists([[t.cpu() for t in tensors] for tensors in lists])
    run_op(amp_C, form, lists, flag(device), **variant)
    run_op(_torch_ops, form, reference, flag("cpu"), **variant)
    assert_same_lists(lists, reference)


@pytest.mark.parametrize("form", FORMS, ids=str)
@pytest.mark.parametrize("fallback_path", ["cpu", "device"])
@pytest.mark.parametrize("noop", [0, 1])
def test_the_fallback_gives_the_same_bits_in_slices_and_on_its_device_path(monkeypatch, form,
                                                                           fallback_path, noop):
    # The fallback works through each tensor in slices (exact.CPU_SLICE elements on the CPU):
    # small ones here, so that they straddle the tensors, against the CPU twin (where built) in one
    # pass. Its device path (no host reads: exact.fma, and the flag applied with torch.where) runs
    # on the CPU too when chosen.
    lists = fuzz_lists(form, "cpu", seed=8, offset=1)
    lists[0][7][5] = float("inf")
    lists[0][6][100] = float("nan")
    reference = clone_lists(lists)
    run_op(amp_C or _torch_ops, form, reference, flag("cpu", noop))  # the twin where it is built
    monkeypatch.setattr(exact, "CPU_SLICE", 100)
    if fallback_path == "device":
        monkeypatch.setattr(exact, "step_tools",
                            lambda noop_flag, device: (exact.fma, (noop_flag != 0).reshape(())))
    run_op(_torch_ops, form, lists, flag("cpu", noop))
    assert_same_lists(lists, reference)


SGD_OPTIONS = [dict(wd=wd, wd_after_momentum=after, momentum=momentum, first_run=first, nesterov=nesterov)
               for wd, after, momentum, first, nesterov in itertools.product(
                   (0.0, 1e-2), (False, True), (0.0, 0.9), (False, True), (False, True))]


@needs_amp_C
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("form", [("sgd", torch.float32, torch.float32, None),
                                  ("sgd", torch.float16, torch.float32, torch.float16)], ids=str)
@pytest.mark.parametrize("options", SGD_OPTIONS, ids=str)
def test_kernel_matches_the_fallback_for_every_combination_of_sgd_options(device, form, options):
    # The CPU twin compiles one loop per combination (dispatched once per piece).
    lists = fuzz_lists(form, device, seed=4, offset=1)
    reference = clone_lists([[t.cpu() for t in tensors] for tensors in lists])
    run_op(amp_C, form, lists, flag(device), **options)
    run_op(_torch_ops, form, reference, flag("cpu"), **options)
    assert_same_lists(lists, reference)


def around_half_blocks(form, device):
    """Lists of ``form`` whose sizes straddle one and two fp16 staging blocks of the CPU twins
    (1024 elements). Some masters are fp16 subnormals, zeros of both signs, values near fp16's
    largest and beyond it, inf and NaN, with zero grads and state there, so that the step only
    decays them (weight decay of 1e-2 times lr) and the model copies hold those fp16 values."""
    gen = torch.Generator().manual_seed(11)
    sizes = [1023, 1024, 1025, 2047, 2048, 2049, 3 * 1024 + 7]
    special = torch.tensor([3e-8, -6e-8, 1e-6, 0.0, -0.0, 65504.0, 65600.0, -7e4, 1e-45,
                            float("inf"), float("nan")])
    dtypes = [form[1], form[2], *([form[2]] * (2 if form[0] == "adam" else 1))]
    dtypes += [form[3]] if form[3] else []
    lists = [[] for _ in dtypes]
    for n in sizes:
        where = torch.randperm(n, generator=gen)[:len(special) * 8]
        for k, dtype in enumerate(dtypes):
            values = torch.randn(n, generator=gen)
            if k == 3 and form[0] == "adam":
                values = values.abs()
            values[where] = special.repeat(8) if k == 1 else 0.0
            lists[k].append(values.to(dtype=dtype, device=device))
    return lists


@needs_amp_C
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("form", [(op, g, torch.float32, torch.float16)
                                  for op in ("sgd", "adam") for g in (torch.float32, *LOW)]
                         + [(op, torch.float16, torch.float16, None) for op in ("sgd", "adam")],
                         ids=str)
@pytest.mark.parametrize("first_run", [False, True])
def test_fp16_stores_match_the_fallback_across_staging_blocks(device, form, first_run):
    # Chunks larger than the staging block, so one piece spans several blocks and a partial one;
    # fp16 model copies, or fp16 weights and state (every list then goes through fp32 blocks).
    lists = around_half_blocks(form, device)
    reference = clone_lists([[t.cpu() for t in tensors] for tensors in lists])
    for impl, tensor_lists, dev in ((amp_C, lists, device), (_torch_ops, reference, "cpu")):
        if form[0] == "sgd":
            impl.multi_tensor_sgd(4096, flag(dev), tensor_lists, 1e-2, 0.9, 0.0, 0.1, False,
                                  first_run, False, 0.5)
        else:
            impl.multi_tensor_adam(4096, flag(dev), tensor_lists, 1e-2, 0.9, 0.999, 1e-8, 3, 1, 1,
                                   1e-2, 0.5)
    assert_same_lists(lists, reference)
    for half in lists[-1] if form[3] else lists[1]:
        tiny = half.float().abs()
        assert torch.isnan(half).any() and (torch.isinf(half).any() or form[3] is None)
        assert ((tiny > 0) & (tiny < 2.0**-14)).any()  # fp16 subnormals


def misuse_cases():
    """(name, op, lists factory, overrides, exception, message) for calls both paths must refuse."""
    def lists(form=("sgd", torch.float16, torch.float32, torch.float16)):
        return lambda: fuzz_lists(form, "cpu", seed=4, offset=0)

    adam = ("adam", torch.float32, torch.float32, None)

    def shared():
        ls = fuzz_lists(("sgd", torch.float32, torch.float32, None), "cpu", seed=4, offset=0)
        ls[2][3] = ls[1][3][: ls[2][3].numel()]  # momentum buffer aliasing the weight
        return ls

    def inference():
        ls = fuzz_lists(adam, "cpu", seed=4, offset=0)
        with torch.inference_mode():
            ls[2][1] = torch.zeros_like(ls[2][1])
        return ls

    def strided():
        ls = fuzz_lists(adam, "cpu", seed=4, offset=0)
        ls[1][2] = torch.zeros(2 * ls[1][2].numel())[::2]
        return ls

    def mixed():
        ls = fuzz_lists(adam, "cpu", seed=4, offset=0)
        ls[3][2] = ls[3][2].half()
        return ls

    def lengths():
        ls = fuzz_lists(adam, "cpu", seed=4, offset=0)
        ls[2].pop()
        return ls

    return [
        ("three lists for adam", "adam", lambda: lists(adam)()[:3], {}, ValueError, "expects"),
        ("five lists for sgd", "sgd", lambda: lists()() + [lists()()[0]], {}, ValueError, "expects"),
        ("fp16 weights with copies", "sgd", lists(("sgd", torch.float16, torch.float16, torch.float16)),
         {}, ValueError, "unsupported dtype combination"),
        ("fp32 copies", "adam", lists(("adam", torch.float16, torch.float32, torch.float32)), {},
         ValueError, "unsupported dtype combination"),
        ("shared memory", "sgd", shared, {}, ValueError, "share memory"),
        ("inference state", "adam", inference, {}, RuntimeError, "inference tensor"),
        ("strided view", "adam", strided, {}, ValueError, "dense"),
        ("mixed dtypes in a list", "adam", mixed, {}, ValueError, "dtype"),
        ("unequal lengths", "adam", lengths, {}, ValueError, "tensor"),
        ("step 0", "adam", lists(adam), dict(step=0), ValueError, "step"),
        ("float64 step tensor", "adam", lists(adam), dict(step=torch.ones(1, dtype=torch.float64)),
         ValueError, "step"),
        ("mode 2", "adam", lists(adam), dict(mode=2), ValueError, "mode"),
        ("float64 inv_scale", "adam", lists(adam), dict(inv_scale=torch.ones(1, dtype=torch.float64)),
         ValueError, "inv_scale"),
        ("float64 scale", "sgd", lists(), dict(scale=torch.ones(1, dtype=torch.float64)),
         ValueError, "scale"),
    ]


@pytest.mark.parametrize("case", misuse_cases(), ids=lambda c: c[0])
@pytest.mark.parametrize("impl", ["fallback", pytest.param("amp_C", marks=needs_amp_C)])
def test_misuse_is_refused_alike_on_every_path_and_writes_nothing(case, impl):
    _, op, make_lists, overrides, error, message = case
    lists = make_lists()
    before = clone_lists(lists)
    with pytest.raises(error, match=message):
        run_op(_torch_ops if impl == "fallback" else amp_C, (op,), lists, flag("cpu"), **overrides)
    assert_same_lists(lists, before)


def test_a_set_flag_on_a_misused_call_still_raises():
    # The flag skips the arithmetic, never the checks: a bad call is reported on a skipped step too.
    lists = fuzz_lists(("sgd", torch.float16, torch.float16, torch.float16), "cpu", seed=4, offset=0)
    with pytest.raises(ValueError, match="unsupported dtype combination"):
        run_op(_torch_ops, ("sgd",), lists, flag("cpu", 1))


# ---- the fallback's fused multiply-add against exact arithmetic -----------------------------------

def round_to_fp32(x):
    """The fp32 value nearest to the Fraction ``x`` (ties to even), as a Python float: inf beyond
    fp32's range, subnormals below 2**-126, a zero with the sign of ``x``."""
    if x == 0:
        return 0.0
    sign, x = (-1.0 if x < 0 else 1.0), abs(x)
    exponent = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** exponent > x:
        exponent -= 1
    quantum = Fraction(2) ** (max(exponent, -126) - 23)  # fp32's ulp there (2**-149 below 2**-126)
    scaled = x / quantum
    units, rest = divmod(scaled.numerator, scaled.denominator)
    rest = Fraction(rest, scaled.denominator)
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and units % 2 == 1):
        units += 1
    value = units * quantum
    return sign * math.inf if value >= 2**128 else sign * float(value)


def exact_fma(a, b, c):
    """fp32(a * b + c) rounded once, from exact rational arithmetic (IEEE rules for zeros, inf, NaN)."""
    if not all(map(math.isfinite, (a, b, c))):
        return a * b + c  # inf or NaN, as IEEE arithmetic gives it (nothing to round)
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    if exact == 0:  # -0 only as the sum of two negative zeros
        product_negative = (math.copysign(1, a) * math.copysign(1, b)) < 0
        return -0.0 if a * b == 0 and product_negative and c == 0 and math.copysign(1, c) < 0 else 0.0
    return round_to_fp32(exact)


def fp32(x):
    return round_to_fp32(Fraction(x)) if math.isfinite(x) else x


def fma_triples(seed=0):
    """(a, b, c) fp32 triples: random ones over the whole range, and adversarial ones whose fp64 sum
    lands on or next to an fp32 rounding midpoint (normal, subnormal, at the overflow threshold)."""
    rng = random.Random(seed)

    def any_fp32():
        kind = rng.random()
        if kind < 0.4:
            return fp32(rng.gauss(0, 1) * 2.0 ** rng.randint(-40, 40))
        if kind < 0.7:
            return fp32(rng.uniform(-1, 1) * 2.0 ** rng.randint(-149, 127))
        return struct.unpack("<f", struct.pack("<I", rng.getrandbits(32)))[0]  # any bits

    triples = [(any_fp32(), any_fp32(), any_fp32()) for _ in range(1500)]
    for _ in range(500):  # c dominant: a * b = half an ulp of c, give or take 2**-2k of it
        c = fp32(rng.uniform(-1, 1) * 2.0 ** rng.randint(-120, 120)) or 1.0
        half_ulp = 2.0 ** (math.frexp(c)[1] - 25)  # c in [2**(e-1), 2**e): ulp 2**(e-24)
        k, i = rng.randint(6, 23), rng.randint(-20, 20)
        a = fp32(2.0 ** i * (1 + 2.0 ** -k))
        b = fp32(half_ulp * 2.0 ** -i * (1 + rng.choice((-1, 1)) * 2.0 ** -k) * rng.choice((-1, 1)))
        triples += [(a, b, c), (a, fp32(3 * b), c)]
    for _ in range(300):  # p dominant and itself a midpoint; c tiny or zero
        k, scale = rng.randint(1, 12), rng.randint(-60, 60)
        a = fp32(2.0 ** scale * (1 + 2.0 ** -k))
        b = fp32(2.0 ** -scale * (1 + 2.0 ** (k - 24)) * rng.choice((-1, 1)))
        triples += [(a, b, fp32(rng.choice((-1, 1)) * 2.0 ** rng.randint(-149, -40))), (a, b, 0.0),
                    (a, b, -0.0)]
    # fp32-subnormal midpoints: c = 2**-127 + 2**-149 (odd), a * b = 2**-150 - 2**-196
    for c in (2.0**-127 + 2.0**-149, 2.0**-127, -(2.0**-127 + 2.0**-149), 2.0**-149, 0.0):
        for u in (1, 3, 255):
            a, b = fp32(2.0**-75 * (1 + u * 2.0**-23)), fp32(2.0**-75 * (1 - u * 2.0**-23))
            triples += [(a, b, c), (a, -b, -c), (a, b, -c)]
    # the overflow threshold 2**128 - 2**103 = 18631 * 1801 * 2**103, and c pushing either way
    for c in (2.0**-100, -(2.0**-100), 0.0, 1.0, -1.0, 2.0**100, -(2.0**100)):
        triples += [(18631.0, 1801.0 * 2.0**103, c), (-18631.0, 1801.0 * 2.0**103, -c)]
    special = [0.0, -0.0, math.inf, -math.inf, math.nan, 2.0**-149, -(2.0**-149), 2.0**-126,
               fp32(3.4028234663852886e38), 1.0, -1.0]
    triples += list(itertools.product(special, repeat=3))
    return triples


def same_fp32_bits(ours, expected):
    """Bit for bit, signed zeros included; any NaN matches any NaN."""
    return torch.equal(torch.isnan(ours), torch.isnan(expected)) and torch.equal(
        torch.where(torch.isnan(ours), 0, ours.view(torch.int32)),
        torch.where(torch.isnan(expected), 0, expected.view(torch.int32)))


def fma_of(name):
    """The fallback's fma by name, called as fma(a, b, c) with a scratch of its own."""
    fma = getattr(exact, name)
    return lambda a, b, c: fma(a, b, c, exact.Scratch(b.device, b.numel()), "result")


FMAS = {"fma": fma_of("fma"), "fma_cpu": fma_of("fma_cpu")}


@pytest.mark.parametrize("name", FMAS)
def test_the_fallbacks_fma_rounds_once_like_exact_arithmetic(name):
    a, b, c = (torch.tensor(column, dtype=torch.float32) for column in zip(*fma_triples()))
    expected = torch.tensor([exact_fma(*t) for t in zip(a.tolist(), b.tolist(), c.tolist())],
                            dtype=torch.float32)
    assert same_fp32_bits(FMAS[name](a, b, c), expected)
    # a 0-dim coefficient, as the optimizers pass their scalars
    for coefficient in (0.1, -3.0, 2.0**-140, 1e30):
        a0 = torch.tensor(coefficient, dtype=torch.float32)
        expected = torch.tensor([exact_fma(a0.item(), y, z) for y, z in zip(b.tolist(), c.tolist())],
                                dtype=torch.float32)
        assert same_fp32_bits(FMAS[name](a0, b, c), expected)


def test_the_cpu_fma_is_exact_with_a_midpoint_or_a_subnormal_among_plain_values():
    # Plain values leave no element to recompute (the fast path alone); a midpoint, or a result in
    # fp32's subnormal range, sends that element through exact.fma, and the others must stay right.
    gen = torch.Generator().manual_seed(7)
    b, c = torch.randn(5000, generator=gen), torch.randn(5000, generator=gen)
    a = torch.tensor(0.1)
    for poke in (None, (2.0**-75 * (1 + 2.0**-23), 2.0**-75 * (1 - 2.0**-23), 2.0**-127 + 2.0**-149),
                 (2.0**3 * (1 + 2.0**-20), 2.0**3 * (1 - 2.0**-20), 2.0**30 + 2.0**7)):
        aa, bb, cc = a.expand(5000).clone(), b.clone(), c.clone()
        if poke is not None:
            aa[1234], bb[1234], cc[1234] = poke
            cc[4321] = float("nan")  # a NaN elsewhere must not hide it
        expected = torch.tensor([exact_fma(*t) for t in zip(aa.tolist(), bb.tolist(), cc.tolist())],
                                dtype=torch.float32)
        assert same_fp32_bits(FMAS["fma_cpu"](aa, bb, cc), expected)
