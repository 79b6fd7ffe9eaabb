"""amp's first-use self-test of ``amp_C`` on one device: a few cases per op, in well under a second.

``amp.multi_tensor_apply`` runs it the first time ``amp_C`` would serve a device in a process (see
its docstring), and uses the kernels there only if every op agrees with the PyTorch fallback;
``python -m amp.check`` shows it as the check ``first-use self-test``. The cases are the kernel
self-test's (``kernel_cases``, compared by ``kernel_compare``) cut down to what a broken build or
an unexpected GPU or CPU would get wrong: nine tensors across chunk boundaries of 512 elements,
some empty, every other one starting one element past an aligned address; every dtype form amp
passes (the fused steps' grad / master / state / model-copy combinations, each pair of scale's
dtypes); host and device coefficients; inf or NaN in an input, and a flag already set. ``scale``
also runs one tensor over two of amp's own chunks, the size at which the CPU kernels split the work
between threads.

An op this table has no cases for runs the first ``FALLBACK_CASES`` cases of the full set, which
``kernel_cases`` lists with the dtype forms on nine tensors first.
"""
from __future__ import annotations

import contextlib
import itertools
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from amp import _pytorch_ops
from amp.casting import disable_casts

from .kernel_cases import (AMP_CHUNK, CHUNK, DTYPES, _adam_forms, _flag, _optimizer_lists, _poison,
                           _sgd_forms, _sizes, _tensors, cases)
from .kernel_compare import Case, Observation, Op, call, compare, dtype_name
from .report import FAIL, PASS, Result, error_line

__all__ = ["CHECK", "FALLBACK_CASES", "first_use_cases", "self_test"]

CHECK = "first-use self-test"
FALLBACK_CASES = 12
_NINE = _sizes(1, 9, CHUNK)


def _coefficient(value: float, device: torch.device, on_device: bool) -> Any:
    """``value`` as amp passes it: a host float, or a 1-element fp32 tensor on the device."""
    return torch.tensor([value], dtype=torch.float32, device=device) if on_device else value


def _scale_cases(device: torch.device) -> Iterator[Case]:
    op = "multi_tensor_scale"
    for i, (src, dst) in enumerate(itertools.product(DTYPES, DTYPES)):
        def make(src: torch.dtype = src, dst: torch.dtype = dst, i: int = i) -> Tuple[Any, ...]:
            gen = torch.Generator().manual_seed(i)
            ins = _tensors(gen, _NINE, src, device, scale=100.0)
            outs = _tensors(gen, _NINE, dst, device, shift=1)
            return CHUNK, _flag(device), [ins, outs], _coefficient(1 / 1024 + 1e-3, device, i % 2 == 0)
        yield Case(f"{dtype_name(src)} -> {dtype_name(dst)}, 9 tensors", call(op, make))
    for dtype in DTYPES:
        def in_place(dtype: torch.dtype = dtype) -> Tuple[Any, ...]:
            ins = _tensors(torch.Generator().manual_seed(10), _NINE, dtype, device, scale=100.0)
            return CHUNK, _flag(device), [ins, ins], _coefficient(0.125, device, True)
        yield Case(f"{dtype_name(dtype)} in place", call(op, in_place))
    for value, where, dtype in ((float("inf"), "middle", torch.float16), (float("nan"), "last", torch.bfloat16)):
        def poisoned(value: float = value, where: str = where, dtype: torch.dtype = dtype) -> Tuple[Any, ...]:
            gen = torch.Generator().manual_seed(11)
            ins = _tensors(gen, _NINE, dtype, device)
            _poison(ins, where, value)
            return CHUNK, _flag(device), [ins, _tensors(gen, _NINE, torch.float32, device)], 0.25
        yield Case(f"{value} at the {where} element of {dtype_name(dtype)} input", call(op, poisoned))

    def flag_set() -> Tuple[Any, ...]:
        gen = torch.Generator().manual_seed(12)
        ins, outs = _tensors(gen, _NINE, torch.float16, device), _tensors(gen, _NINE, torch.float32, device)
        return CHUNK, _flag(device, 1, torch.float32), [ins, outs], 0.5
    yield Case("a float32 flag already set stays set", call(op, flag_set))

    def two_chunks() -> Tuple[Any, ...]:
        gen = torch.Generator().manual_seed(13)
        ins = _tensors(gen, [AMP_CHUNK + 3], torch.float16, device, scale=100.0)
        return AMP_CHUNK, _flag(device), [ins, _tensors(gen, [AMP_CHUNK + 3], torch.float32, device)], 2.0**-7
    yield Case(f"float16 -> float32, one tensor over two chunks of {AMP_CHUNK}", call(op, two_chunks))


def _axpby_cases(device: torch.device) -> Iterator[Case]:
    op = "multi_tensor_axpby"
    # A Latin square: every pair of dtypes of (x, y), (x, out) and (y, out) appears once.
    triples = [(DTYPES[i], DTYPES[j], DTYPES[(i + j) % 3]) for i in range(3) for j in range(3)]
    for i, (xd, yd, od) in enumerate(triples):
        def make(xd: torch.dtype = xd, yd: torch.dtype = yd, od: torch.dtype = od, i: int = i) -> Tuple[Any, ...]:
            gen = torch.Generator().manual_seed(100 + i)
            xs, ys = _tensors(gen, _NINE, xd, device), _tensors(gen, _NINE, yd, device, shift=1)
            on_device = i % 2 == 0
            return (CHUNK, _flag(device), [xs, ys, _tensors(gen, _NINE, od, device)],
                    _coefficient(0.3, device, on_device), _coefficient(-1.7, device, on_device), i % 3 - 1)
        yield Case(f"{dtype_name(xd)}, {dtype_name(yd)} -> {dtype_name(od)}, arg_to_check={i % 3 - 1}",
                   call(op, make))
    for poisoned, arg_to_check, value in (("x", 0, float("inf")), ("y", -1, float("nan")), ("y", 0, float("inf"))):
        def bad(poisoned: str = poisoned, arg_to_check: int = arg_to_check, value: float = value) -> Tuple[Any, ...]:
            gen = torch.Generator().manual_seed(110)
            xs, ys = _tensors(gen, _NINE, torch.float16, device), _tensors(gen, _NINE, torch.float32, device)
            _poison(xs if poisoned == "x" else ys, "middle", value)
            return CHUNK, _flag(device), [xs, ys, xs], 1.0, 0.5, arg_to_check
        yield Case(f"{value} in {poisoned}, arg_to_check={arg_to_check}, in place over x", call(op, bad))


def _norm_cases(op: str, device: torch.device) -> Iterator[Case]:
    unscale = op == "multi_tensor_unscale_l2norm"
    for i, dtype in enumerate(DTYPES):
        def make(dtype: torch.dtype = dtype, i: int = i) -> Tuple[Any, ...]:
            xs = _tensors(torch.Generator().manual_seed(200 + i), _NINE, dtype, device)
            extra = (_coefficient(1 / 512, device, i % 2 == 0),) if unscale else ()
            return (CHUNK, _flag(device), [xs], *extra, i != 1)
        yield Case(f"{dtype_name(dtype)}, per_tensor={i != 1}", call(op, make))
    for value, flag in ((float("inf"), 0), (1.0, 1)):
        def special(value: float = value, flag: int = flag) -> Tuple[Any, ...]:
            xs = _tensors(torch.Generator().manual_seed(210), _NINE, torch.float16, device)
            _poison(xs, "middle", value)
            extra = (0.5,) if unscale else ()
            return (CHUNK, _flag(device, flag), [xs], *extra, True)
        label = "inf at the middle element" if flag == 0 else "a flag already set"
        yield Case(label, call(op, special))


def _hysteresis_cases(device: torch.device) -> Iterator[Case]:
    # (hysteresis, growth_interval, (min_scale, max_scale) with inv_scale and should_skip, or ())
    for hysteresis, interval, bounds in ((2, 2, (2.0**14, 2.0**17)), (1, 3, ())):
        def run(op: Op, hysteresis: int = hysteresis, interval: int = interval,
                bounds: Tuple[float, ...] = bounds) -> List[Observation]:
            found = [1.0, 0.0, 3.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
            state = [torch.tensor([2.0**16], dtype=torch.float32, device=device),
                     torch.zeros(1, dtype=torch.int32, device=device),
                     torch.tensor([hysteresis], dtype=torch.int32, device=device)]
            outputs = [torch.full((1,), 7.0, dtype=torch.float32, device=device) for _ in range(2)] if bounds else []
            names = ["current_scale", "growth_tracker", "hysteresis_tracker", "inv_scale", "should_skip"]
            seen: List[Observation] = []
            for step, value in enumerate(found):
                op(*state, torch.tensor([value], dtype=torch.float32, device=device), 2.0, 0.5, interval,
                   hysteresis, *bounds, *outputs)
                seen += [(f"step {step}: {name}", t.clone(), True) for name, t in zip(names, state + outputs)]
            return seen
        clamp = f", clamped to {bounds[0]}..{bounds[1]} with inv_scale/should_skip" if bounds else ""
        yield Case(f"12 steps, hysteresis {hysteresis}, growth_interval {interval}{clamp}", run)


def _optimizer_cases(op: str, device: torch.device, forms: Sequence[Tuple[torch.dtype, ...]],
                     configs: Sequence[Tuple[Any, ...]], extra: Callable[[int], Tuple[Any, ...]],
                     special: Callable[[bool], Tuple[Any, ...]], positive: Tuple[int, ...]) -> Iterator[Case]:
    """Every dtype form once with ``configs`` in turn and ``extra(i)`` after them; then an inf in a
    grad and a set flag, with ``special(coefficients on the device)`` after the lists."""
    for i, form in enumerate(forms):
        def make(form: Tuple[torch.dtype, ...] = form, i: int = i) -> Tuple[Any, ...]:
            gen = torch.Generator().manual_seed(400 + i)
            lists = _optimizer_lists(gen, _NINE, form, device, grad_scale=1024.0, positive=positive)
            return (CHUNK, _flag(device), lists, *configs[i % len(configs)], *extra(i))
        label = "/".join(dtype_name(d) for d in form)
        yield Case(f"[{label}], config {i % len(configs)}", call(op, make))
    for flag in (0, 1):
        def poisoned(flag: int = flag) -> Tuple[Any, ...]:
            gen = torch.Generator().manual_seed(420)
            lists = _optimizer_lists(gen, _NINE, forms[-1], device, grad_scale=1024.0, positive=positive)
            _poison(lists[0], "middle", float("inf"))
            return (CHUNK, _flag(device, flag), lists, *special(flag == 0))
        yield Case("inf in a grad" if flag == 0 else "a set flag writes nothing", call(op, poisoned))


def _sgd_cases(device: torch.device) -> Iterator[Case]:
    # (wd, momentum, dampening, lr, nesterov, first_run, wd_after_momentum)
    configs = [(1e-2, 0.9, 0.1, 0.05, False, False, False), (1e-2, 0.9, 0.0, 0.05, True, True, False),
               (1e-3, 0.9, 0.0, 0.1, False, False, True), (0.0, 0.0, 0.0, 0.1, False, False, False)]

    def scale(i: int) -> Tuple[Any, ...]:
        return (_coefficient(2.0**-10, device, i % 2 == 0),)

    def special(on_device: bool) -> Tuple[Any, ...]:
        return (*configs[0], _coefficient(2.0**-10, device, on_device))
    return _optimizer_cases("multi_tensor_sgd", device, _sgd_forms(), configs, scale, special, ())


def _adam_cases(device: torch.device) -> Iterator[Case]:
    # (lr, beta1, beta2, eps); then step, mode, bias_correction, weight_decay come from ``extra``.
    configs = [(1e-3, 0.9, 0.999, 1e-8), (1e-2, 0.3, 0.99, 1e-8), (1e-2, 0.0, 0.9, 1e-6)]

    def step_and_scale(i: int) -> Tuple[Any, ...]:
        on_device = i % 2 == 0
        step = torch.tensor([i + 1], dtype=torch.int64, device=device) if on_device else i + 1
        return step, i % 2, int(i % 3 != 2), 1e-2 * (i % 2), _coefficient(2.0**-10, device, on_device)

    def special(on_device: bool) -> Tuple[Any, ...]:
        return (*configs[0], *step_and_scale(0 if on_device else 1))
    return _optimizer_cases("multi_tensor_adam", device, _adam_forms(), configs, step_and_scale, special, (3,))


def _lamb_cases(device: torch.device) -> Iterator[Case]:
    # (lr, beta1, beta2, eps); then step, bias_correction, weight_decay, grad_averaging, mode,
    # global_grad_norm, max_grad_norm, use_nvlamb and inv_scale come from ``extra``.
    configs = [(1e-3, 0.9, 0.999, 1e-6), (1e-2, 0.3, 0.99, 1e-8), (1e-2, 0.0, 0.9, 1e-6)]

    def extra(i: int) -> Tuple[Any, ...]:
        on_device = i % 2 == 0
        return (i + 1, int(i % 3 != 2), 1e-2 * (i % 2), int(i % 4 != 3), i % 2,
                _coefficient(3.0 if i % 3 else 0.5, device, on_device), 1.0, i % 5 == 4,
                _coefficient(2.0**-10, device, on_device))

    def special(on_device: bool) -> Tuple[Any, ...]:
        return (*configs[0], *extra(0 if on_device else 1))
    return _optimizer_cases("multi_tensor_lamb", device, _adam_forms(remainders=False), configs, extra, special,
                            (3,))


_CASES: Dict[str, Callable[[torch.device], Iterator[Case]]] = {
    "multi_tensor_scale": _scale_cases,
    "multi_tensor_axpby": _axpby_cases,
    "multi_tensor_l2norm": lambda device: _norm_cases("multi_tensor_l2norm", device),
    "multi_tensor_l2norm_mp": lambda device: _norm_cases("multi_tensor_l2norm_mp", device),
    "multi_tensor_unscale_l2norm": lambda device: _norm_cases("multi_tensor_unscale_l2norm", device),
    "update_scale_hysteresis": _hysteresis_cases,
    "multi_tensor_sgd": _sgd_cases,
    "multi_tensor_adam": _adam_cases,
    "multi_tensor_lamb": _lamb_cases,
}


def first_use_cases(op: str, device: torch.device) -> Iterator[Case]:
    """The cases of ``op`` in the first-use self-test."""
    if op in _CASES:
        return _CASES[op](device)
    return itertools.islice(cases(op, device, quick=True), FALLBACK_CASES)


def _first_failure(kernels: Any, device: torch.device) -> Tuple[int, Optional[str]]:
    """(cases run, the first failure or None); stops at the first failure: one is enough to
    distrust the build on this device."""
    count = 0
    for op in _pytorch_ops.__all__:
        kernel = getattr(kernels, op, None)
        if kernel is None:
            continue
        for case in first_use_cases(op, device):
            count += 1
            problem = compare(case, kernel, getattr(_pytorch_ops, op))
            if problem is not None:
                return count, f"{op}: {problem}"
    return count, None


def self_test(kernels: Any, device: torch.device) -> Result:
    """Every op of ``kernels`` (``amp_C``) that amp has a PyTorch version of, against that version on
    ``device``; a failure's detail names the op, the case and the first difference (or the error).

    Whatever the caller set up is kept out: a default device (the cases make CPU tensors without
    naming a device), autocast, amp's own casts, and on a GPU the sync debug mode (the test reads
    results on the host). The caller's current device and stream are kept: the ops meet them so.
    """
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if torch.empty(0).device.type != "cpu":  # a default device (a mode: it would slow every op)
            stack.enter_context(torch.device("cpu"))
        stack.enter_context(torch.autocast(device.type, enabled=False))
        stack.enter_context(disable_casts())
        if device.type == "cuda":
            stack.callback(torch.cuda.set_sync_debug_mode, torch.cuda.get_sync_debug_mode())
            torch.cuda.set_sync_debug_mode(0)
        try:
            count, failure = _first_failure(kernels, device)
        except Exception as err:  # noqa: BLE001 - a test that cannot run proves nothing
            count, failure = 0, f"the self-test raised {error_line(err)}"
    seconds = time.perf_counter() - start
    if failure is not None:
        return Result(CHECK, str(device), FAIL, failure, count, seconds)
    return Result(CHECK, str(device), PASS, "every amp_C op equals the fallback on a few cases", count, seconds)
