"""amp_C's remainders forms of multi_tensor_adam and multi_tensor_sgd against the fallback.

``[grads, bf16 weights, state..., int16 remainders]`` (amp/_pytorch_ops/remainder.py): amp_C (its
CPU twin; its CUDA kernel under ``-m cuda``) and the PyTorch fallback must write the same bits to
the weights, the remainders (low halves, padding and carry words) and the state, and those must be
the bits of the model-copy form ``[grads, fp32 masters, state..., bf16 copies]`` stepped on the
rebuilt masters. Sizes straddle the carry words (32 elements) and the chunks (where the CPU twin's
pieces and the CUDA blocks begin), and the masters' low halves sit on and around bf16's rounding
midpoint. The training runs are in test_remainder_masters.py.
"""
import itertools

import pytest
import torch

from amp import _pytorch_ops
from amp._pytorch_ops import remainder
from amp.multi_tensor_apply import amp_C

pytestmark = pytest.mark.skipif(amp_C is None, reason="amp_C is not built")
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.cuda))
AMP_CHUNK = 2048 * 32
FLT_MAX_BITS = 0x7F7FFFFF


def kernel_device(device):
    if device == "cuda" and not amp_C.cuda_available():
        pytest.fail("a GPU is present but amp_C was built without CUDA support (AMP_CUDA_EXT=1)")
    return device


def sizes_for(chunk):
    return [0, 1, 31, 32, 33, 63, 64, 65, 0, chunk - 1, chunk, chunk + 1, 2 * chunk + 33, 97]


def fp32_of_bits(bits):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def adversarial_masters(n, gen):
    """fp32 masters, most with a low half at or next to bf16's rounding midpoint: 0x8000 under an
    even and an odd top half (ties to even: down, up), 0x7fff, 0x8001, 0; then zeros of both signs,
    infinities, NaN and the largest finite values (which round to a bf16 infinity, carry set)."""
    bits = torch.randn(n, generator=gen).view(torch.int32)
    top = bits & -0x10000
    kind = torch.randint(0, 8, (n,), generator=gen)
    for k, value in enumerate(((top & -0x20000) | 0x8000, top | 0x18000, top | 0x7FFF, top | 0x8001, top)):
        bits = torch.where(kind == k, value, bits)
    special = fp32_of_bits([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, FLT_MAX_BITS,
                            0xFF7FFFFF, 0x7F7F8000, 0x00000001, 0x00018000])
    masters = bits.view(torch.float32).clone()
    where = torch.randperm(n, generator=gen)[:len(special)]
    masters[where] = special[:len(where)]
    return masters


def garbled(packed, n):
    """``packed`` with ones where remainders hold nothing (an odd count's padding, the last carry
    word's bits past ``n``): both paths write zeros there."""
    if n % 32:
        packed[remainder.carry_offset(n):].view(torch.int32)[-1] |= -(1 << (n % 32))
    if n % 2:
        packed[n] = -1
    return packed


def make_lists(op, sizes, grad_dtype, seed, offset=0, device="cpu"):
    """(remainders lists, fp32 masters): ``[grads, bf16 weights, state..., remainders]``, each
    tensor ``offset`` elements into a buffer of its own (so not 16-byte aligned when odd; the
    remainders 2 * offset int16, as they must stay 4-byte aligned)."""
    gen = torch.Generator().manual_seed(seed)

    def placed(t, shift):
        buffer = torch.empty(t.numel() + shift, dtype=t.dtype, device=device)
        buffer[shift:] = t
        return buffer[shift:]

    grads, weights, packs, masters = [], [], [], []
    states = [[] for _ in range(2 if op == "adam" else 1)]
    for n in sizes:
        master = adversarial_masters(n, gen)
        weight, packed = torch.empty(n, dtype=torch.bfloat16), remainder.new_remainders(n, "cpu")
        remainder.split(master, weight, packed)
        masters.append(master.to(device))
        grads.append(placed((torch.randn(n, generator=gen) * 1024).to(grad_dtype), offset))
        weights.append(placed(weight, offset))
        packs.append(placed(garbled(packed, n), 2 * offset))
        for k, state in enumerate(states):
            values = torch.randn(n, generator=gen)
            state.append(placed(values.abs() if k == 1 else values, offset))
    return [grads, weights, *states, packs], masters


ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.999, epsilon=1e-8, step=5, mode=1, bias_correction=True,
            weight_decay=1e-2, inv_scale=2.0**-10)
SGD = dict(wd=1e-2, momentum=0.9, dampening=0.1, lr=0.1, nesterov=True, first_run=False,
           wd_after_momentum=False, scale=2.0**-10)


def run(impl, op, chunk, lists, noop=None, **options):
    noop = torch.zeros(1, dtype=torch.int32, device=lists[0][0].device) if noop is None else noop
    if op == "adam":
        impl.multi_tensor_adam(chunk, noop, lists, **(ADAM | options))
    else:
        impl.multi_tensor_sgd(chunk, noop, lists, **(SGD | options))
    return noop


def clone_lists(lists, device=None):
    return [[t.to(device or t.device, copy=True) for t in tensors] for tensors in lists]


def same_bits(a, b):
    """Bit for bit, except that a NaN matches any NaN: its bits differ between paths (a NaN master's
    weight is 0x7fc0 in amp_C, torch's CPU conversion to bf16 gives 0xffff)."""
    if not a.is_floating_point():
        return b.dtype == a.dtype and torch.equal(a, b)
    ints = torch.int32 if a.dtype == torch.float32 else torch.int16
    numbers = ~torch.isnan(a)
    return a.dtype == b.dtype and torch.equal(numbers, ~torch.isnan(b)) and torch.equal(
        a.view(ints)[numbers], b.view(ints)[numbers])


def assert_same_remainders_lists(ours, theirs):
    """Every tensor bit for bit (remainders keep no NaN payload, a NaN weight or state its own)."""
    for k, (a_list, b_list) in enumerate(zip(ours, theirs)):
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            assert same_bits(a.cpu(), b.cpu()), f"tensor_lists[{k}][{i}] differs"


def on_cpu(options):
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in options.items()}


def assert_is_the_model_copy_form(op, chunk, lists, stepped, masters, **options):
    """``stepped`` (the remainders form after one step from ``lists``) holds the masters, state and
    bf16 copies of the model-copy form stepped (by the fallback) on the masters ``lists`` encode."""
    cpu = clone_lists(lists, "cpu")
    rebuilt = [remainder.rebuild(w, p) for w, p in zip(cpu[1], cpu[-1])]
    assert all(same_bits(r, m.cpu()) for r, m in zip(rebuilt, masters))
    copies = [torch.empty_like(w) for w in cpu[1]]
    run(_pytorch_ops, op, chunk, [cpu[0], rebuilt, *cpu[2:-1], copies], **on_cpu(options))
    ours = clone_lists(stepped, "cpu")
    for i, (master, copy) in enumerate(zip(rebuilt, copies)):
        assert same_bits(ours[1][i], copy), f"weight {i}"
        assert same_bits(remainder.rebuild(ours[1][i], ours[-1][i]), master), f"master {i}"
        weight, packed = torch.empty_like(copy), remainder.new_remainders(master.numel(), "cpu")
        remainder.split(master, weight, packed)
        assert torch.equal(ours[-1][i], packed), f"remainders {i}"
    for state, expected in zip(ours[2:-1], cpu[2:-1]):
        assert all(same_bits(a, b) for a, b in zip(state, expected))


def step_both(op, chunk, lists, device, noop_value=0, **options):
    """One step by amp_C on ``lists`` and by the fallback on CPU copies; returns the copies."""
    reference = clone_lists(lists, "cpu")
    noop = torch.full((1,), noop_value, dtype=torch.int32, device=device)
    run(amp_C, op, chunk, lists, noop, **options)
    run(_pytorch_ops, op, chunk, reference, torch.full((1,), noop_value, dtype=torch.int32), **on_cpu(options))
    assert noop.item() == noop_value  # the ops never set the flag
    return reference


# ---- every size, dtype and alignment, on and around the rounding midpoints ------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk", [64, AMP_CHUNK])
@pytest.mark.parametrize("op", ["adam", "sgd"])
def test_amp_C_steps_the_remainders_as_the_fallback_and_the_model_copy_form(device, offset, grad_dtype, chunk, op):
    device = kernel_device(device)
    lists, masters = make_lists(op, sizes_for(chunk), grad_dtype, 1 + offset, offset, device)
    before = clone_lists(lists)
    reference = step_both(op, chunk, lists, device)
    assert_same_remainders_lists(lists, reference)
    assert_is_the_model_copy_form(op, chunk, before, lists, masters)


ADAM_OPTIONS = [dict(mode=mode, weight_decay=wd) for mode, wd in itertools.product((0, 1), (0.0, 1e-2))] + [
    dict(beta1=0.0), dict(beta1=0.6, mode=0, weight_decay=0.1), dict(bias_correction=False),
    dict(step=2**31 - 1), dict(step=torch.tensor([3], dtype=torch.int64)), dict(inv_scale=torch.tensor([0.5]))]
SGD_OPTIONS = [dict(wd=wd, wd_after_momentum=after, momentum=momentum, first_run=first, nesterov=nesterov)
               for wd, after, momentum, first, nesterov in itertools.product(
                   (0.0, 1e-2), (False, True), (0.0, 0.9), (False, True), (False, True))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op, options", [("adam", o) for o in ADAM_OPTIONS] + [("sgd", o) for o in SGD_OPTIONS],
                         ids=lambda v: v if isinstance(v, str) else str({k: str(x) for k, x in v.items()}))
def test_every_option_of_the_remainders_form(device, op, options):
    device = kernel_device(device)
    options = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    lists, masters = make_lists(op, sizes_for(64), torch.bfloat16, seed=7, offset=1, device=device)
    before = clone_lists(lists)
    reference = step_both(op, 64, lists, device, **options)
    assert_same_remainders_lists(lists, reference)
    assert_is_the_model_copy_form(op, 64, before, lists, masters, **options)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["adam", "sgd"])
def test_many_tensors_and_one_of_over_320_chunks(device, op):
    # More tensors than one CUDA launch takes (30 or 36), and a tensor whose chunks continue into
    # the next launch (320 blocks each).
    device = kernel_device(device)
    sizes = [37 * k % 301 for k in range(40)] + [64 * 330 + 17]
    lists, masters = make_lists(op, sizes, torch.float16, seed=9, offset=1, device=device)
    before = clone_lists(lists)
    reference = step_both(op, 64, lists, device)
    assert_same_remainders_lists(lists, reference)
    assert_is_the_model_copy_form(op, 64, before, lists, masters)


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_that_keeps_the_masters_keeps_weights_and_remainders(device):
    # SGD with lr 0, zero grads and no decay or momentum: w = fma(-0, 0, w) is every master as it
    # went in, so the adversarial low halves go through the kernel's rebuild and split alone.
    device = kernel_device(device)
    lists, _ = make_lists("sgd", sizes_for(64), torch.float32, seed=3, device=device)
    for grad in lists[0]:
        grad.zero_()
    expected = clone_lists(lists, "cpu")
    for w, p in zip(expected[1], expected[-1]):
        remainder.split(remainder.rebuild(w, p), w, p)  # the padding zeroed
    run(amp_C, "sgd", 64, lists, lr=0.0, wd=0.0, momentum=0.0)
    assert_same_remainders_lists(lists, expected)


# ---- inf and NaN grads, and the noop flag ---------------------------------------------------------


POISON = [("first", float("inf")), ("middle", float("nan")), ("last", float("-inf"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("noop_value", [0, 1])
@pytest.mark.parametrize("where, value", POISON, ids=str)
@pytest.mark.parametrize("op", ["adam", "sgd"])
def test_inf_and_nan_grads(device, noop_value, where, value, op):
    # Flagged (as the scaler flags a step with an inf/NaN grad): nothing is written. Unflagged:
    # both paths step the non-finite masters alike (a NaN's low half and carry 0).
    device = kernel_device(device)
    lists, _ = make_lists(op, sizes_for(64), torch.float16, seed=11, device=device)
    poisoned = [(i, {"first": 0, "middle": lists[0][i].numel() // 2, "last": lists[0][i].numel() - 1}[where])
                for i in (2, 9, 12)]
    for i, j in poisoned:
        lists[0][i][j] = value
    before = clone_lists(lists)
    reference = step_both(op, 64, lists, device, noop_value)
    assert_same_remainders_lists(lists, reference)
    if noop_value:
        assert_same_remainders_lists(lists, before)
    else:
        assert all(not torch.isfinite(lists[1][i][j]) for i, j in poisoned)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flag_dtype", [torch.int32, torch.float32])
@pytest.mark.parametrize("op", ["adam", "sgd"])
def test_a_set_flag_writes_nothing_not_even_the_padding(device, flag_dtype, op):
    device = kernel_device(device)
    for impl in (amp_C, _pytorch_ops):
        lists, _ = make_lists(op, sizes_for(64), torch.bfloat16, seed=5, device=device)
        before = clone_lists(lists)
        noop = run(impl, op, 64, lists, torch.ones(1, dtype=flag_dtype, device=device))
        assert_same_remainders_lists(lists, before)
        assert noop.item() == 1


@pytest.mark.cuda
def test_on_cuda_a_step_tensor_out_of_range_skips_the_remainders_form():
    device = kernel_device("cuda")
    lists, _ = make_lists("adam", sizes_for(64), torch.bfloat16, seed=6, device=device)
    before = clone_lists(lists)
    noop = run(amp_C, "adam", 64, lists, step=torch.zeros(1, dtype=torch.int64, device=device))
    assert_same_remainders_lists(lists, before)
    assert noop.item() == 1


# ---- refusals: both paths alike, and nothing written ----------------------------------------------


def replace_remainders(i, make):
    def mutate(args):
        lists = args["lists"]
        lists[-1][i] = make(lists[1][i].numel())
    return mutate


def misuses():
    def packed(n, extra=0):
        return torch.zeros(remainder.packed_numel(n) + extra, dtype=torch.int16)

    def as_dtype(k, dtype):
        def mutate(args):
            args["lists"][k] = [t.to(dtype) for t in args["lists"][k]]
        return mutate

    def chunk(value):
        def mutate(args):
            args["chunk"] = value
        return mutate

    def int16_after_a_float(args):  # the last list's first tensor decides: the model-copy form
        lists = args["lists"]
        lists[-1][0] = torch.zeros(lists[1][0].numel(), dtype=torch.bfloat16)

    def float_after_int16(args):
        lists = args["lists"]
        lists[-1][1] = torch.zeros(lists[1][1].numel(), dtype=torch.bfloat16)

    def shared(args):
        lists = args["lists"]
        lists[-1][2] = lists[-2][2].view(torch.int16)[:remainder.packed_numel(lists[1][2].numel())]

    def inference(args):
        with torch.inference_mode():
            args["lists"][-1][1] = args["lists"][-1][1].clone()

    return [
        ("too many remainders", replace_remainders(1, lambda n: packed(n, 2))),
        ("too few remainders", replace_remainders(1, lambda n: packed(n)[:-2])),
        ("non-contiguous remainders", replace_remainders(1, lambda n: torch.zeros(2 * remainder.packed_numel(n), dtype=torch.int16)[::2])),
        ("remainders at an odd int16 offset", replace_remainders(1, lambda n: packed(n, 1)[1:])),
        ("remainders on another device", replace_remainders(1, lambda n: packed(n).to("meta"))),
        ("int32 remainders", replace_remainders(1, lambda n: packed(n).to(torch.int32))),
        ("chunk_size 48", chunk(48)),
        ("chunk_size 100", chunk(100)),
        ("fp32 weights", as_dtype(1, torch.float32)),
        ("fp16 weights", as_dtype(1, torch.float16)),
        ("bf16 state", as_dtype(2, torch.bfloat16)),
        ("an int16 tensor after a bf16 one in the last list", int16_after_a_float),
        ("a bf16 tensor after an int16 one in the last list", float_after_int16),
        ("remainders sharing the state's memory", shared),
        ("inference remainders", inference),
    ]


@pytest.mark.parametrize("label, misuse", misuses(), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("op", ["adam", "sgd"])
def test_a_misused_remainders_form_is_refused_alike_and_writes_nothing(op, label, misuse):
    refusals = []
    for impl in (amp_C, _pytorch_ops):
        lists, _ = make_lists(op, [5, 40, 33], torch.float16, seed=2)
        args = dict(lists=lists, chunk=64)
        misuse(args)
        before = [[t.clone() for t in tensors] for tensors in args["lists"] if all(t.device.type == "cpu" for t in tensors)]
        with pytest.raises(Exception) as info:
            run(impl, op, args["chunk"], args["lists"])
        refusals.append((type(info.value), str(info.value)))
        after = [tensors for tensors in args["lists"] if all(t.device.type == "cpu" for t in tensors)]
        assert all(same_bits(a, b) for x, y in zip(after, before) for a, b in zip(x, y))
    assert refusals[0] == refusals[1]

