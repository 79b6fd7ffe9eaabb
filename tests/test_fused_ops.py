"""The fused optimizer ops multi_tensor_sgd / multi_tensor_adam on every path.

Each test runs the pure-PyTorch fallback, the CPU twin of amp_C (where it is built) and, under
``-m cuda``, the CUDA kernel. References are torch.optim's SGD / Adam / AdamW (``foreach=False``)
run on fp32 copies of the same data: the ops follow their fp32 arithmetic (fused multiply-adds
included), so both are compared bit for bit, Adam's reference stepping with the correctly rounded
square root that the kernels take (torch's CPU sqrt is not correctly rounded on every build).
"""
import itertools

import pytest
import torch

from amp import _torch_ops
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

