"""The multi-tensor ops' argument contract (amp/_pytorch_ops/contract.py) on both paths.

``amp_C`` and the PyTorch ops must refuse every misuse alike: the same exception type and the
same message, whichever rule it breaks, for every op. Then the rules added for issue 27: the
tensors of one index must store their elements in one order, no call may number more chunks
than the CUDA launcher's int32 can, and adam's step tensor is checked like its int. Last, the
remainders forms of sgd and adam (``[grads, bf16 weights, state..., int16 remainders]``).
"""
import math
import warnings

import pytest
import torch

from amp import _pytorch_ops
from amp._pytorch_ops import contract, remainder, storage
from amp.multi_tensor_apply import amp_C

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
needs_amp_C = pytest.mark.skipif(amp_C is None, reason="amp_C is not built")
PATHS = ("fallback", pytest.param("amp_C", marks=needs_amp_C))
CHUNK = 64
INT32_MAX = 2**31 - 1

LIST_COUNTS = {
    "multi_tensor_scale": 2, "multi_tensor_axpby": 3, "multi_tensor_l2norm": 1,
    "multi_tensor_l2norm_mp": 1, "multi_tensor_unscale_l2norm": 1, "multi_tensor_sgd": 3,
    "multi_tensor_adam": 4, "multi_tensor_lamb": 4,
}
COEFFICIENTS = {
    "multi_tensor_scale": dict(scale=0.5),
    "multi_tensor_axpby": dict(a=0.5, b=0.25, arg_to_check=-1),
    "multi_tensor_l2norm": dict(per_tensor=True),
    "multi_tensor_l2norm_mp": dict(per_tensor=True),
    "multi_tensor_unscale_l2norm": dict(inv_scale=0.5, per_tensor=True),
    "multi_tensor_sgd": dict(wd=0.01, momentum=0.9, dampening=0.0, lr=0.1, nesterov=False,
                             first_run=False, wd_after_momentum=False, scale=1.0),
    "multi_tensor_adam": dict(lr=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-8, step=3, mode=1,
                              bias_correction=1, weight_decay=0.01, inv_scale=1.0),
    "multi_tensor_lamb": dict(lr=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-6, step=3, bias_correction=1,
                              weight_decay=0.01, grad_averaging=1, mode=1, global_grad_norm=2.0,
                              max_grad_norm=1.0, use_nvlamb=None, inv_scale=1.0),
}
LIST_OPS = list(LIST_COUNTS)
SEVERAL_LISTS = [op for op in LIST_OPS if LIST_COUNTS[op] > 1]
WITH_OUTPUTS = ["multi_tensor_scale", "multi_tensor_axpby"]
FUSED = ["multi_tensor_sgd", "multi_tensor_adam", "multi_tensor_lamb"]
# Every dtype torch can make on the CPU outside float32, float16 and bfloat16.
OTHER_DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}
                      - {torch.float32, torch.float16, torch.bfloat16}, key=str)


def can_make(dtype):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex32 is experimental
            torch.zeros(2, 3, 2, 2).to(dtype)
    except (RuntimeError, TypeError):
        return False
    return True


def valid_call(op):
    """A valid call of ``op`` as keyword arguments, with fresh tensors: per list a 5-element
    tensor and a 4-d one (so that it can be made channels_last)."""
    gen = torch.Generator().manual_seed(0)
    lists = [[torch.rand(5, generator=gen), torch.rand(2, 3, 2, 2, generator=gen)]
             for _ in range(LIST_COUNTS[op])]
    return dict(chunk_size=CHUNK, noop_flag=torch.zeros(1, dtype=torch.int32), tensor_lists=lists,
                **COEFFICIENTS[op])


def valid_scale_update():
    return dict(current_scale=torch.full((1,), 2.0**16), growth_tracker=torch.zeros(1, dtype=torch.int32),
                hysteresis_tracker=torch.ones(1, dtype=torch.int32), found_inf=torch.zeros(1),
                growth_factor=2.0, backoff_factor=0.5, growth_interval=10, hysteresis=2,
                min_scale=1.0, max_scale=2.0**24, inv_scale=torch.zeros(1), should_skip=torch.zeros(1))


def arg(name, make):
    """A misuse: the argument ``name`` replaced by ``make()`` (fresh on every call)."""
    def mutate(args):
        args[name] = make()
    return mutate


def in_lists(mutate_lists):
    def mutate(args):
        mutate_lists(args["tensor_lists"])
    return mutate


def inference(shape=(1,), dtype=torch.float32):
    with torch.inference_mode():
        return torch.zeros(shape, dtype=dtype)


def replace(k, i, make):
    """A misuse: ``tensor_lists[k][i]`` replaced by ``make(that tensor)``."""
    def mutate(lists):
        lists[k][i] = make(lists[k][i])
    return in_lists(mutate)


def overlapping_outputs(lists):
    base = torch.zeros(30)
    lists[-1][0], lists[-1][1] = base[:5], base[3:27].view(2, 3, 2, 2)


def output_over_another_input(lists):
    lists[-1][0] = lists[0][1].view(-1)[:5]


def shared_state(lists):
    lists[2][0] = lists[1][1].view(-1)[7:12]


def transposed_against_flat(lists):
    lists[0][1] = torch.zeros(6, 4).t()
    for tensors in lists[1:]:
        tensors[1] = torch.zeros(24)


def half_weights(lists):
    lists[1][:] = [t.half() for t in lists[1]]


def no_tensors_and_a_float64_flag(args):
    args["noop_flag"] = torch.zeros(1, dtype=torch.float64)
    args["tensor_lists"] = [[] for _ in args["tensor_lists"]]


def too_many_chunks_in_all(args):
    # 2049 views of one 2**20-element tensor: 2**31 + 2**20 chunks of one element, in 4 MB.
    x = torch.zeros(2**20)
    args["tensor_lists"] = [[x] * 2049]
    args["chunk_size"] = 1


LIST_MISUSES = [
    # rule 1: chunk_size
    *((f"chunk_size={v!r}", op, arg("chunk_size", lambda v=v: v))
      for v in (0, -3, True, 2.0, 2**63) for op in LIST_OPS),
    # rule 2: the lists
    *(("one list too many", op, in_lists(lambda lists: lists.append([torch.zeros(5), torch.zeros(2, 3, 2, 2)])))
      for op in LIST_OPS),
    *(("no lists", op, arg("tensor_lists", list)) for op in LIST_OPS),
    *(("a list one tensor short", op, in_lists(lambda lists: lists[-1].pop())) for op in SEVERAL_LISTS),
    # rule 3: the flag
    *((f"a {what} flag", op, arg("noop_flag", make)) for op in LIST_OPS for what, make in (
        ("float64", lambda: torch.zeros(1, dtype=torch.float64)), ("2-element", lambda: torch.zeros(2, dtype=torch.int32)),
        ("0-element", lambda: torch.zeros(0, dtype=torch.int32)))),
    *(("a float64 flag with no tensors", op, no_tensors_and_a_float64_flag) for op in LIST_OPS),
    # rule 4: host numbers
    *((f"{name}={value!r}", op, arg(name, lambda value=value: value)) for op, name, value in (
        ("multi_tensor_axpby", "arg_to_check", 1.0), ("multi_tensor_axpby", "arg_to_check", True),
        ("multi_tensor_sgd", "wd", True), ("multi_tensor_sgd", "lr", "0.1"), ("multi_tensor_sgd", "momentum", None),
        ("multi_tensor_sgd", "dampening", 10**400),
        ("multi_tensor_adam", "lr", False), ("multi_tensor_adam", "beta1", torch.tensor(0.9)),
        ("multi_tensor_adam", "mode", 2), ("multi_tensor_adam", "mode", 1.0), ("multi_tensor_adam", "mode", True),
        ("multi_tensor_adam", "mode", 2**70), ("multi_tensor_adam", "bias_correction", 1.0),
        ("multi_tensor_adam", "weight_decay", 1j),
        ("multi_tensor_lamb", "grad_averaging", 0.5), ("multi_tensor_lamb", "use_nvlamb", "yes"),
        ("multi_tensor_lamb", "mode", 3), ("multi_tensor_lamb", "max_grad_norm", None),
        ("multi_tensor_lamb", "step", 0), ("multi_tensor_lamb", "step", 2**31),
        ("multi_tensor_lamb", "step", torch.ones(1, dtype=torch.int64)))),
    # rule 5: each tensor
    *((f"a {dtype} tensor in list {k}", op, replace(k, 0, lambda t, dtype=dtype: t.to(dtype)))
      for dtype in OTHER_DTYPES if can_make(dtype) for op in LIST_OPS for k in {0, LIST_COUNTS[op] - 1}),
    *((f"mixed dtypes in list {k}", op, replace(k, 1, lambda t: t.half()))
      for op in LIST_OPS for k in {0, LIST_COUNTS[op] - 1}),
    *(("a tensor on another device", op, replace(LIST_COUNTS[op] - 1, 1, lambda t: t.to("meta")))
      for op in LIST_OPS),
    *(("another numel", op, replace(LIST_COUNTS[op] - 1, 1, lambda t: torch.zeros(13))) for op in SEVERAL_LISTS),
    *((f"a {what} view", op, replace(LIST_COUNTS[op] - 1, 1, make)) for op in LIST_OPS for what, make in (
        ("strided", lambda t: torch.zeros(2, 3, 2, 4)[..., ::2]), ("expanded", lambda t: torch.zeros(1, 3, 2, 2).expand(2, 3, 2, 2)))),
    *(("a channels_last tensor against a contiguous one", op,
       replace(k, 1, lambda t: t.contiguous(memory_format=torch.channels_last)))
      for op in SEVERAL_LISTS for k in range(1, LIST_COUNTS[op])),
    *(("a transposed matrix against a flat buffer", op, in_lists(transposed_against_flat))
      for op in SEVERAL_LISTS),
    # rule 6: chunks
    *(("2**31 chunks in all", op, too_many_chunks_in_all) for op in LIST_OPS if LIST_COUNTS[op] == 1),
    # rule 7: across lists
    *(("overlapping outputs", op, in_lists(overlapping_outputs)) for op in WITH_OUTPUTS),
    *(("an output over another index's input", op, in_lists(output_over_another_input)) for op in WITH_OUTPUTS),
    *(("state sharing memory", op, in_lists(shared_state)) for op in FUSED),
    *(("fp16 weights with fp32 state", op, in_lists(half_weights)) for op in FUSED),
    # rule 8: writes
    *(("a flag on another device", op, arg("noop_flag", lambda: torch.zeros(1, dtype=torch.int32, device="meta")))
      for op in LIST_OPS),
    *(("an inference flag", op, arg("noop_flag", lambda: inference(dtype=torch.int32))) for op in LIST_OPS),
    *(("an inference output", op, replace(LIST_COUNTS[op] - 1, 1, lambda t: inference(t.shape)))
      for op in WITH_OUTPUTS + FUSED),
    # rule 9: coefficients that may be tensors
    *((f"{name} as {what}", op, arg(name, make)) for op, name in (
        ("multi_tensor_scale", "scale"), ("multi_tensor_axpby", "a"), ("multi_tensor_axpby", "b"),
        ("multi_tensor_unscale_l2norm", "inv_scale"), ("multi_tensor_sgd", "scale"), ("multi_tensor_adam", "inv_scale"),
        ("multi_tensor_lamb", "global_grad_norm"), ("multi_tensor_lamb", "inv_scale"))
      for what, make in (("a float64 tensor", lambda: torch.ones(1, dtype=torch.float64)),
                         ("a 2-element tensor", lambda: torch.ones(2)), ("a meta tensor", lambda: torch.ones(1, device="meta")),
                         ("a bool", lambda: True), ("a string", lambda: "1.0"))),
    *((f"step={what}", "multi_tensor_adam", arg("step", make)) for what, make in (
        ("0", lambda: 0), ("-1", lambda: -1), ("2**31", lambda: 2**31), ("2**70", lambda: 2**70), ("True", lambda: True),
        ("1.0", lambda: 1.0), ("an int tensor of 0", lambda: torch.zeros(1, dtype=torch.int64)),
        ("an int32 tensor of -5", lambda: torch.full((1,), -5, dtype=torch.int32)),
        ("an int64 tensor of 2**31", lambda: torch.full((1,), 2**31, dtype=torch.int64)),
        ("a float tensor of 1.5", lambda: torch.full((1,), 1.5)), ("a float tensor of 2**31", lambda: torch.full((1,), 2.0**31)),
        ("a float tensor of nan", lambda: torch.full((1,), math.nan)), ("a float tensor of -inf", lambda: torch.full((1,), -math.inf)),
        ("a float tensor of 0.1", lambda: torch.full((1,), 0.1)),
        ("a float64 tensor", lambda: torch.ones(1, dtype=torch.float64)), ("a 2-element tensor", lambda: torch.ones(2, dtype=torch.int64)),
        ("a meta tensor", lambda: torch.ones(1, dtype=torch.int64, device="meta")))),
]

SCALE_UPDATE_MISUSES = [
    *((f"{name} as a {what}", arg(name, make)) for name in ("current_scale", "growth_tracker", "hysteresis_tracker", "found_inf")
      for what, make in (("float64 tensor", lambda: torch.ones(1, dtype=torch.float64)), ("2-element int32 tensor", lambda: torch.ones(2, dtype=torch.int32)),
                         ("meta float32 tensor", lambda: torch.ones(1, device="meta")))),
    *((f"{name}={value!r}", arg(name, lambda value=value: value)) for name, value in (
        ("growth_factor", True), ("backoff_factor", "0.5"), ("growth_interval", 2**31), ("growth_interval", 1.0),
        ("hysteresis", -(2**31) - 1), ("hysteresis", True), ("min_scale", 1e39), ("min_scale", 10**40),
        ("max_scale", math.nan), ("max_scale", False), ("min_scale", 10**400))),
    *((f"{name} as a {what}", arg(name, make)) for name in ("inv_scale", "should_skip") for what, make in (
        ("int32 tensor", lambda: torch.zeros(1, dtype=torch.int32)), ("meta tensor", lambda: torch.zeros(1, device="meta")))),
    *((f"an inference {name}", arg(name, lambda name=name: inference(dtype=valid_scale_update()[name].dtype)))
      for name in ("current_scale", "growth_tracker", "hysteresis_tracker", "inv_scale", "should_skip")),
]


def refusal(call):
    with pytest.raises(Exception) as info:
        call()
    return type(info.value), str(info.value)


@needs_amp_C
@pytest.mark.parametrize("label, op, misuse", LIST_MISUSES, ids=lambda v: v if isinstance(v, str) else "")
def test_both_paths_refuse_a_misuse_of_a_list_op_alike(label, op, misuse):
    refusals = []
    for ops in (amp_C, _pytorch_ops):
        args = valid_call(op)
        misuse(args)
        refusals.append(refusal(lambda: getattr(ops, op)(**args)))
    assert refusals[0] == refusals[1]


# ---- the remainders forms of sgd and adam ---------------------------------------------------------


def valid_remainders_call(op):
    """A valid call of sgd's or adam's remainders form: valid_call's lists with bf16 weights, and
    their remainders as a last list."""
    args = valid_call(op)
    lists = args["tensor_lists"]
    lists[1] = [t.bfloat16() for t in lists[1]]
    lists.append([remainder.new_remainders(t.numel(), "cpu") for t in lists[1]])
    return args


def int16(numel):
    return torch.zeros(numel, dtype=torch.int16)


def lists_as(k, dtype):
    def mutate(lists):
        lists[k] = [t.to(dtype) for t in lists[k]]
    return in_lists(mutate)


def remainders_over_a_weight(lists):
    lists[-1][0] = lists[1][1].view(-1).view(torch.int16)[:remainder.packed_numel(5)]


REMAINDER_OPS = {"multi_tensor_sgd": 3, "multi_tensor_adam": 4}  # the index of the remainders' list
REMAINDER_MISUSES = [
    # rule 2: an int16 first tensor in the last list chooses the remainders form, else model copies
    *(("an int16 tensor after a bf16 one in the last list", op, replace(k, 0, lambda t: t.bfloat16()))
      for op, k in REMAINDER_OPS.items()),
    *(("a bf16 tensor after an int16 one in the last list", op, replace(k, 1, lambda t: int16(24).bfloat16()))
      for op, k in REMAINDER_OPS.items()),
    # rule 5: each tensor of remainders
    *((f"remainders {what}", op, replace(k, i, make)) for op, k in REMAINDER_OPS.items() for what, i, make in (
        ("as int32", 1, lambda t: t.int()), ("on another device", 1, lambda t: t.to("meta")),
        ("at an odd int16 offset", 1, lambda t: int16(t.numel() + 1)[1:]),
        ("at an odd int16 offset and two too many", 1, lambda t: int16(t.numel() + 3)[1:]),
        ("two too many", 1, lambda t: int16(t.numel() + 2)), ("two too few", 1, lambda t: int16(t.numel() - 2)),
        ("of a 24-element tensor for a 5-element one", 0, lambda t: int16(remainder.packed_numel(24))),
        ("not contiguous", 1, lambda t: int16(2 * t.numel())[::2]),
        ("not contiguous and too many", 1, lambda t: int16(2 * t.numel() + 4)[::2]))),
    *((f"chunk_size={value} with remainders", op, arg("chunk_size", lambda value=value: value))
      for op in REMAINDER_OPS for value in (48, 100, 2**20 + 16)),
    # rule 7: dtypes and memory
    *((f"{name} as {dtype}", op, lists_as(k, dtype)) for op in REMAINDER_OPS for k, name, dtype in (
        (1, "weights", torch.float32), (1, "weights", torch.float16), (2, "state", torch.bfloat16),
        (2, "state", torch.float16))),
    *(("remainders over a weight", op, in_lists(remainders_over_a_weight)) for op in REMAINDER_OPS),
    # rule 8: writes
    *(("inference remainders", op, replace(k, 1, lambda t: inference(t.shape, torch.int16)))
      for op, k in REMAINDER_OPS.items()),
]


@needs_amp_C
@pytest.mark.parametrize("label, op, misuse", REMAINDER_MISUSES, ids=lambda v: v if isinstance(v, str) else "")
def test_both_paths_refuse_a_misuse_of_a_remainders_form_alike(label, op, misuse):
    refusals = []
    for ops in (amp_C, _pytorch_ops):
        args = valid_remainders_call(op)
        misuse(args)
        refusals.append(refusal(lambda: getattr(ops, op)(**args)))
    assert refusals[0] == refusals[1]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", REMAINDER_OPS)
def test_sgd_and_adam_step_their_remainders_forms(path, op):
    args = valid_remainders_call(op)
    lists = args["tensor_lists"]
    masters = [remainder.rebuild(w.view(-1), r) for w, r in zip(lists[1], lists[-1])]
    run(path, op, args)
    assert not any(torch.equal(remainder.rebuild(w.view(-1), r), m) for w, r, m in zip(lists[1], lists[-1], masters))


@pytest.mark.parametrize("path", PATHS)
def test_lamb_has_no_remainders_form(path):
    # An int16 last list is lamb's model copies, refused as such.
    args = {**valid_call("multi_tensor_lamb"), "tensor_lists": valid_remainders_call("multi_tensor_adam")["tensor_lists"]}
    with pytest.raises(ValueError, match=r"tensor_lists\[4\]\[0\] \(model_copies\) has dtype torch.int16"):
        run(path, "multi_tensor_lamb", args)


@needs_amp_C
@pytest.mark.parametrize("label, misuse", SCALE_UPDATE_MISUSES, ids=lambda v: v if isinstance(v, str) else "")
def test_both_paths_refuse_a_misuse_of_the_scale_update_alike(label, misuse):
    refusals = []
    for ops in (amp_C, _pytorch_ops):
        args = valid_scale_update()
        misuse(args)
        refusals.append(refusal(lambda: ops.update_scale_hysteresis(**args)))
    assert refusals[0] == refusals[1]



# ---- issue 27 item 3: the tensors of one index store their elements in one order ------------------


def run(path, op, args):
    return getattr(amp_C if path == "amp_C" else _pytorch_ops, op)(**args)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", SEVERAL_LISTS)
def test_a_channels_last_tensor_paired_with_a_contiguous_one_is_refused_before_any_write(path, op):
    # A channels_last param with a contiguous .grad: paired in memory order, their elements would
    # not match up.
    args = valid_call(op)
    lists = args["tensor_lists"]
    lists[1][1] = lists[1][1].contiguous(memory_format=torch.channels_last)
    before = [[t.clone() for t in tensors] for tensors in lists]
    with pytest.raises(ValueError, match=r"tensor_lists\[1\]\[1\] \(\w+\) stores its elements in another "
                                         r"order than tensor_lists\[0\]\[1\].*torch.channels_last"):
        run(path, op, args)
    assert all(torch.equal(a, b) for tensors, old in zip(lists, before) for a, b in zip(tensors, old))
    assert args["noop_flag"].item() == 0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", SEVERAL_LISTS)
def test_channels_last_tensors_of_one_index_pair_element_by_element(path, op):
    args = valid_call(op)
    reference = valid_call(op)
    for lists in (args["tensor_lists"], reference["tensor_lists"]):
        for tensors in lists:
            tensors[1] = tensors[1].contiguous(memory_format=torch.channels_last)
    for tensors in reference["tensor_lists"]:
        tensors[1] = tensors[1].contiguous()
    run(path, op, args)
    run(path, op, reference)
    for ours, theirs in zip(args["tensor_lists"], reference["tensor_lists"]):
        assert ours[1].is_contiguous(memory_format=torch.channels_last)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


# ---- issue 27 item 5: the CUDA launcher numbers chunks in int32 ------------------------------------


class Sized:
    """Stands in for a tensor where only the numel is read."""

    def __init__(self, numel):
        self._numel = numel

    def numel(self):
        return self._numel


@pytest.mark.parametrize("numel, chunk_size, refused", [
    (INT32_MAX, 1, False), (INT32_MAX + 1, 1, True), (2 * INT32_MAX, 2, False), (2 * INT32_MAX + 1, 2, True),
    (2**62, 2**31, True), (2**62, 2**32, False)])
def test_a_tensor_may_span_at_most_2_31_minus_1_chunks(numel, chunk_size, refused):
    def check():
        contract._check_chunk_counts("op", chunk_size, [Sized(numel)], ("x",), in_all=False)
    if refused:
        with pytest.raises(ValueError, match=f"{-(-numel // chunk_size)} chunks of chunk_size {chunk_size}"):
            check()
    else:
        check()


@pytest.mark.parametrize("counts, refused", [([INT32_MAX - 1, 1], False), ([INT32_MAX - 1, 2], True),
                                             ([2**20] * 2047 + [2**20 - 1], False), ([2**20] * 2048, True)])
def test_the_l2norm_family_numbers_all_chunks_together(counts, refused):
    tensors = [Sized(n) for n in counts]
    contract._check_chunk_counts("op", 1, tensors, ("x",), in_all=False)  # each alone is fine
    if refused:
        with pytest.raises(ValueError, match="in all"):
            contract._check_chunk_counts("op", 1, tensors, ("x",), in_all=True)
    else:
        contract._check_chunk_counts("op", 1, tensors, ("x",), in_all=True)


@pytest.mark.parametrize("path", PATHS)
def test_a_tensor_of_2_31_one_element_chunks_is_refused(path, tmp_path):
    # 2**31 fp16 elements mapped from a sparse file: nothing is allocated, and nothing is read
    # before the refusal.
    x = torch.from_file(str(tmp_path / "big"), shared=True, size=2**31, dtype=torch.float16)
    flag = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"tensor_lists\[0\]\[0\] \(in\) has 2147483648 elements, "
                                         r"2147483648 chunks of chunk_size 1"):
        run(path, "multi_tensor_scale", dict(chunk_size=1, noop_flag=flag, tensor_lists=[[x], [x]], scale=2.0))
    assert flag.item() == 0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", [op for op in LIST_OPS if LIST_COUNTS[op] == 1])
def test_more_than_2_31_chunks_in_all_are_refused_by_the_l2norm_family(path, op):
    args = valid_call(op)
    too_many_chunks_in_all(args)
    with pytest.raises(ValueError, match="make 2148532224 chunks of chunk_size 1 in all"):
        run(path, op, args)


# ---- issue 27 item 4: adam's step ------------------------------------------------------------------

BAD_STEPS = [
    pytest.param(lambda: torch.zeros(1, dtype=torch.int64), "0", id="int64 0"),
    pytest.param(lambda: torch.full((1,), -1, dtype=torch.int32), "-1", id="int32 -1"),
    pytest.param(lambda: torch.full((1,), 2**31, dtype=torch.int64), "2147483648", id="int64 2**31"),
    pytest.param(lambda: torch.zeros(1), "0", id="float32 0"),
    pytest.param(lambda: torch.full((1,), 2.5), "2.5", id="float32 2.5"),
    pytest.param(lambda: torch.full((1,), 2.0**31), "2.14748365e\\+09", id="float32 2**31"),
    pytest.param(lambda: torch.full((1,), math.nan), "nan", id="float32 nan"),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("make_step, shown", BAD_STEPS)
def test_a_cpu_step_tensor_out_of_range_is_refused_before_any_write(path, make_step, shown):
    args = valid_call("multi_tensor_adam")
    args["step"] = make_step()
    before = [[t.clone() for t in tensors] for tensors in args["tensor_lists"]]
    with pytest.raises(ValueError, match=f"step is the step number after this update, 1 to 2147483647; got {shown}$"):
        run(path, "multi_tensor_adam", args)
    assert all(torch.equal(a, b) for tensors, old in zip(args["tensor_lists"], before) for a, b in zip(tensors, old))


@pytest.mark.parametrize("make_step, shown", BAD_STEPS)
def test_on_a_device_a_step_out_of_range_makes_a_skipped_flagged_step(monkeypatch, make_step, shown):
    # The fallback's device path (no host reads), run on the CPU.
    monkeypatch.setattr(storage, "read_on_host", lambda device: False)
    args = valid_call("multi_tensor_adam")
    args["step"] = make_step()
    before = [[t.clone() for t in tensors] for tensors in args["tensor_lists"]]
    _pytorch_ops.multi_tensor_adam(**args)
    assert all(torch.equal(a, b) for tensors, old in zip(args["tensor_lists"], before) for a, b in zip(tensors, old))
    assert args["noop_flag"].item() == 1


@pytest.mark.parametrize("step", [1, 7, INT32_MAX])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
def test_a_step_tensor_in_range_steps_as_its_int_does(monkeypatch, step, dtype):
    if dtype == torch.float32 and step == INT32_MAX:
        step = 2**31 - 128  # the largest fp32 below 2**31
    expected = valid_call("multi_tensor_adam")
    _pytorch_ops.multi_tensor_adam(**{**expected, "step": step})
    for on_host in (True, False):
        monkeypatch.setattr(storage, "read_on_host", lambda device, on_host=on_host: on_host)
        args = valid_call("multi_tensor_adam")
        _pytorch_ops.multi_tensor_adam(**{**args, "step": torch.full((1,), step, dtype=dtype)})
        assert all(torch.equal(a, b) for ours, theirs in zip(args["tensor_lists"], expected["tensor_lists"])
                   for a, b in zip(ours, theirs))
        assert args["noop_flag"].item() == 0


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["fallback", "amp_C"])
@pytest.mark.parametrize("make_step, shown", BAD_STEPS)
def test_on_cuda_a_step_out_of_range_makes_a_skipped_flagged_step(path, make_step, shown):
    if path == "amp_C" and (amp_C is None or not amp_C.cuda_available()):
        pytest.fail("a GPU is present but amp_C was built without CUDA support (AMP_CUDA_EXT=1)")
    args = valid_call("multi_tensor_adam")
    args["tensor_lists"] = [[t.cuda() for t in tensors] for tensors in args["tensor_lists"]]
    args["noop_flag"] = args["noop_flag"].cuda()
    args["step"] = make_step().cuda()
    before = [[t.clone() for t in tensors] for tensors in args["tensor_lists"]]
    run(path, "multi_tensor_adam", args)
    assert all(torch.equal(a, b) for tensors, old in zip(args["tensor_lists"], before) for a, b in zip(tensors, old))
    assert args["noop_flag"].item() == 1
