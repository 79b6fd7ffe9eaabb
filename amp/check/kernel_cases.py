"""The cases of ``amp.check.kernels``, op family by op family, and the data they run on.

The cases cross what the kernels' launchers cut: chunk boundaries, more tensors (110) and more
chunks (320) than one CUDA launch holds, empty tensors first, in the middle and last, tensors
that start one element past an aligned address, every dtype pair, and inf/NaN at the first, the
middle and the last element of a list.
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import random
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from amp import _pytorch_ops
from amp._pytorch_ops import remainder

from .kernel_compare import Case, Observation, Op, call, dtype_name

__all__ = ["CHUNK", "AMP_CHUNK", "cases"]

# Small, so that tensors straddle chunks and a list exceeds a CUDA launch's 320 chunks cheaply.
CHUNK = 512
# amp's own chunk size (multi_tensor_applier's): straddled once per op in the full run.
AMP_CHUNK = _pytorch_ops.contract.AMP_CHUNK_SIZE
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOW = (torch.float16, torch.bfloat16)
NON_FINITE = (float("inf"), float("-inf"), float("nan"))
WHERE = ("first", "middle", "last")


# ---- data ----------------------------------------------------------------------------------------


def _tensors(gen: torch.Generator, sizes: Sequence[int], dtype: torch.dtype, device: torch.device,
             scale: float = 1.0, shift: int = 0, positive: bool = False) -> List[torch.Tensor]:
    """Random tensors of ``sizes``: views into one buffer, every other one (by ``shift``) after a
    one-element gap, so that their addresses are aligned or not in every pattern."""
    starts, total = [], 0
    for i, n in enumerate(sizes):
        total += (i + shift) % 2
        starts.append(total)
        total += n
    values = torch.randn(total, generator=gen) * scale
    buffer = (values.abs() if positive else values).to(dtype=dtype, device=device)
    return [buffer[start:start + n] for start, n in zip(starts, sizes)]


def _poison(tensors: Sequence[torch.Tensor], where: str, value: float) -> None:
    """``value`` at the first element of the list, the middle of its middle tensor, or its last."""
    non_empty = [t for t in tensors if t.numel() > 0]
    if where == "first":
        non_empty[0][0] = value
    elif where == "middle":
        t = non_empty[len(non_empty) // 2]
        t[t.numel() // 2] = value
    else:
        non_empty[-1][-1] = value


def _flag(device: torch.device, value: int = 0, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.full((1,), value, dtype=dtype, device=device)


def _sizes(seed: int, count: int, chunk: int) -> List[int]:
    """``count`` sizes around multiples of ``chunk``, empty first, in the middle and last."""
    rng = random.Random(seed)
    pool = [1, 3, 8, 17, chunk - 1, chunk, chunk + 1, 2 * chunk + 5, 3 * chunk]
    sizes = [rng.choice(pool) for _ in range(count)]
    if count >= 3:
        for i in (0, count // 2, count - 1):
            sizes[i] = 0
    return sizes


@dataclasses.dataclass
class Layout:
    """The sizes of one tensor list and the chunk size it is cut with."""

    label: str
    sizes: List[int]
    chunk: int


def _layouts(quick: bool, many: int = 130) -> List[Layout]:
    """The lists every op runs on. One CUDA launch holds 110 tensors of one list (fewer of several:
    30 for five lists), so ``many`` tensors need several."""
    layouts = [
        Layout("9 tensors", _sizes(1, 9, CHUNK), CHUNK),
        Layout(f"{many} tensors", ([0, 1, 3, 17, CHUNK + 1] * many)[:many], CHUNK),
        Layout("330 chunks in one tensor", [5, 330 * CHUNK + 7, 3], CHUNK),
    ]
    if not quick:
        layouts += [
            Layout("1 tensor", [2 * CHUNK + 5], CHUNK),
            Layout("40 tensors", _sizes(2, 40, CHUNK), CHUNK),
            Layout(f"amp's chunk of {AMP_CHUNK}", [AMP_CHUNK - 1, AMP_CHUNK, 0, AMP_CHUNK + 1], AMP_CHUNK),
            Layout("only empty tensors", [0, 0, 0], CHUNK),
        ]
    return layouts


def _main_layouts(quick: bool) -> List[Layout]:
    """The layouts every dtype combination runs on; the others run a few."""
    layouts = _layouts(quick)
    return layouts[:1] if quick else [layouts[0], layouts[3], layouts[4]]


def _quick_subset(quick: bool, combinations: Sequence[Tuple[Any, ...]],
                  values: Sequence[Any]) -> List[Tuple[Any, ...]]:
    """Every combination with every value, or with ``--quick`` each combination with one value
    in turn (so every combination and every value still appear)."""
    if not quick:
        return [(*c, v) for c in combinations for v in values]
    count = max(len(combinations), len(values))
    return [(*combinations[i % len(combinations)], values[i % len(values)]) for i in range(count)]


# ---- the cases, op by op ---------------------------------------------------------------------------


def _scale_cases(device: torch.device, quick: bool) -> Iterator[Case]:
    op = "multi_tensor_scale"
    for layout in _layouts(quick):
        pairs = itertools.product(DTYPES, DTYPES) if layout in _main_layouts(quick) else [
            (torch.float16, torch.float32), (torch.float32, torch.bfloat16)]
        for i, (src, dst) in enumerate(pairs):
            def make(layout: Layout = layout, src: torch.dtype = src, dst: torch.dtype = dst,
                     seed: int = i) -> Tuple[Any, ...]:
                gen = torch.Generator().manual_seed(seed)
                ins = _tensors(gen, layout.sizes, src, device, scale=100.0)
                outs = _tensors(gen, layout.sizes, dst, device, shift=1)
                return layout.chunk, _flag(device), [ins, outs], 1 / 1024 + 1e-3
            yield Case(f"{dtype_name(src)} -> {dtype_name(dst)}, {layout.label}", call(op, make))
    nine = _sizes(1, 9, CHUNK)
    for value, where, src in _quick_subset(quick, list(itertools.product(NON_FINITE, WHERE)), DTYPES):
        def poisoned(src: torch.dtype = src, value: float = value, where: str = where) -> Tuple[Any, ...]:
            gen = torch.Generator().manual_seed(3)
            ins = _tensors(gen, nine, src, device)
            _poison(ins, where, value)
            return CHUNK, _flag(device), [ins, _tensors(gen, nine, torch.float32, device)], 0.25
        yield Case(f"{value} at the {where} element of {dtype_name(src)} input", call(op, poisoned))

    def special(flag_value: int = 0, flag_dtype: torch.dtype = torch.int32, tensor_scale: bool = False,
                in_place: bool = False, big: bool = False) -> Callable[[], Tuple[Any, ...]]:
        def make() -> Tuple[Any, ...]:
            gen = torch.Generator().manual_seed(4)
            ins = _tensors(gen, nine, torch.float16 if not big else torch.float32, device,
                           scale=60000.0 if big else 1.0)
            outs = ins if in_place else _tensors(gen, nine, torch.float16, device)
            scale: Any = 4.0 if big else 0.125
            if tensor_scale:
                scale = torch.tensor([scale], device=device)
            return CHUNK, _flag(device, flag_value, flag_dtype), [ins, outs], scale
        return make
    yield Case("a flag already set stays set", call(op, special(flag_value=1)))
    yield Case("a float32 flag", call(op, special(flag_dtype=torch.float32)))
    yield Case("a device tensor as scale", call(op, special(tensor_scale=True)))
    yield Case("in place", call(op, special(in_place=True)))
    yield Case("fp16 overflow made by the multiply (not flagged)", call(op, special(big=True)))
    for dst in LOW:
        def ties(dst: torch.dtype = dst) -> Tuple[Any, ...]:
            # Midpoints between neighbouring dst values, and values one fp32 ulp either side.
            gen = torch.Generator().manual_seed(5)
            low = torch.randn(3000, generator=gen).to(dst)
            bits = low.view(torch.int16)
            high = (bits + 1).view(dst)
            mid = (low.double() + high.double()).div(2).float()
            values = torch.cat([mid, mid.nextafter(torch.tensor(float("inf"))),
                                mid.nextafter(torch.tensor(float("-inf"))),
                                torch.tensor([1e-6, 3e-8, 65520.0, -65519.0, 0.0, -0.0])])
            ins = [values.to(device)]
            return CHUNK, _flag(device), [ins, [torch.empty(values.numel(), dtype=dst, device=device)]], 1.0
        yield Case(f"rounding ties, subnormals and overflow into {dtype_name(dst)}", call(op, ties))


def _axpby_cases(device: torch.device, quick: bool) -> Iterator[Case]:
    op = "multi_tensor_axpby"
    for layout in _layouts(quick):
        if layout not in _main_layouts(quick):
            triples: Iterable[Tuple[torch.dtype, ...]] = [
                (torch.float16, torch.float32, torch.float16),
                (torch.bfloat16, torch.bfloat16, torch.float32)]
        elif quick:
            # A Latin square: every pair of dtypes of (x, y), (x, out) and (y, out) appears once.
            triples = [(DTYPES[i], DTYPES[j], DTYPES[(i + j) % 3]) for i in range(3) for j in range(3)]
        else:
            triples = itertools.product(DTYPES, DTYPES, DTYPES)
        for i, (xd, yd, od) in enumerate(triples):
            def make(layout: Layout = layout, xd: torch.dtype = xd, yd: torch.dtype = yd,
                     od: torch.dtype = od, seed: int = i) -> Tuple[Any, ...]:
                gen = torch.Generator().manual_seed(100 + seed)
                xs = _tensors(gen, layout.sizes, xd, device)
                ys = _tensors(gen, layout.sizes, yd, device, shift=1)
                outs = _tensors(gen, layout.sizes, od, device)
                return layout.chunk, _flag(device), [xs, ys, outs], 0.3, -1.7, -1
            yield Case(f"{dtype_name(xd)}, {dtype_name(yd)} -> {dtype_name(od)}, {layout.label}", call(op, make))
    nine = _sizes(1, 9, CHUNK)
    checks = [(-1, "x"), (-1, "y"), (0, "x"), (0, "y"), (1, "x"), (1, "y"), (2, "x")]
    positions = list(itertools.product(NON_FINITE, WHERE))
    for arg_to_check, poisoned, (value, where) in _quick_subset(quick, checks, positions):
        def bad(arg_to_check: int = arg_to_check, poisoned: str = poisoned, value: float = value,
                where: str = where) -> Tuple[Any, ...]:
            gen = torch.Generator().manual_seed(101)
            xs = _tensors(gen, nine, torch.float16, device)
            ys = _tensors(gen, nine, torch.float32, device)
            _poison(xs if poisoned == "x" else ys, where, value)
            outs = _tensors(gen, nine, torch.float32, device)
            return CHUNK, _flag(device), [xs, ys, outs], 1.0, 2.0, arg_to_check
        label = f"{value} at the {where} element of {poisoned}, arg_to_check={arg_to_check}"
        yield Case(label, call(op, bad))

    def special(tensors: bool = False, in_place: bool = False) -> Tuple[Any, ...]:
        gen = torch.Generator().manual_seed(102)
        xs = _tensors(gen, nine, torch.float32, device)
        ys = _tensors(gen, nine, torch.bfloat16, device)
        outs = xs if in_place else _tensors(gen, nine, torch.float32, device)
        a: Any = torch.tensor([0.5], device=device) if tensors else 0.5
        b: Any = torch.tensor([0.25], device=device) if tensors else 0.25
        return CHUNK, _flag(device), [xs, ys, outs], a, b, 0
    yield Case("device tensors as a and b", call(op, lambda: special(tensors=True)))
    yield Case("in place over x", call(op, lambda: special(in_place=True)))


def _norm_cases(op: str, device: torch.device, quick: bool) -> Iterator[Case]:
    unscale = op == "multi_tensor_unscale_l2norm"
    for layout in _layouts(quick):
        dtypes = DTYPES if layout in _main_layouts(quick) else (torch.float16,)
        for dtype, per_tensor in itertools.product(dtypes, (False, True)):
            def make(layout: Layout = layout, dtype: torch.dtype = dtype,
                     per_tensor: bool = per_tensor) -> Tuple[Any, ...]:
                gen = torch.Generator().manual_seed(200)
                xs = _tensors(gen, layout.sizes, dtype, device, scale=1000.0 if unscale else 1.0)
                extra = (1 / 512,) if unscale else ()
                return (layout.chunk, _flag(device), [xs], *extra, per_tensor)
            yield Case(f"{dtype_name(dtype)}, per_tensor={per_tensor}, {layout.label}", call(op, make))
    nine = _sizes(1, 9, CHUNK)

    def special(values: Optional[List[List[float]]] = None, poison: Optional[Tuple[float, str]] = None,
                flag_value: int = 0, tensor_scale: bool = False) -> Callable[[], Tuple[Any, ...]]:
        def make() -> Tuple[Any, ...]:
            gen = torch.Generator().manual_seed(201)
            if values is None:
                xs = _tensors(gen, nine, torch.float16, device)
            else:
                xs = [torch.tensor(v, device=device) for v in values]
            if poison is not None:
                _poison(xs, poison[1], poison[0])
            scale: Any = torch.tensor([0.5], device=device) if tensor_scale else 0.5
            extra = (scale,) if unscale else ()
            return (CHUNK, _flag(device, flag_value), [xs], *extra, True)
        return make
    for value, where in _quick_subset(quick, [(float("inf"),), (float("nan"),)], WHERE):
        yield Case(f"{value} at the {where} element", call(op, special(poison=(value, where))))
    # Sums of squares beyond fp32's range: inf and flagged on every path, though the norm would fit.
    yield Case("a sum of squares beyond fp32", call(op, special(values=[[1e19] * 4, [1.0]])))
    yield Case("a total beyond fp32, each tensor's within", call(op, special(values=[[1e19] * 2] * 2)))
    yield Case("a flag already set", call(op, special(flag_value=1)))
    if unscale:
        yield Case("a device tensor as inv_scale", call(op, special(tensor_scale=True)))


def _hysteresis_cases(device: torch.device, quick: bool) -> Iterator[Case]:
    steps = 40 if quick else 150
    names = list(inspect.signature(_pytorch_ops.update_scale_hysteresis).parameters)
    configs: List[Tuple[int, int, Tuple[Any, ...], float, float]] = [
        (1, 3, (), 2.0, 0.5), (3, 2, (), 2.0, 0.5), (2, 1, (), 2.0, 0.5),
        (1, 2, (2.0**-24, 2.0**24), 4.0, 0.3), (2, 1, (0.1, 3e5), 4.0, 0.3),
        (1, 2, (None, 2.0**17), 4.0, 0.3), (2, 1, (2.0**14, None), 4.0, 0.3),
        (1, 1, (2.0**15, 2.0**15), 2.0, 0.5), (1, 10, (), 2.0, 2.0**-30),
    ]
    for hysteresis, interval, bounds, growth, backoff in configs:
        def run(op: Op, hysteresis: int = hysteresis, interval: int = interval,
                bounds: Tuple[Any, ...] = bounds, growth: float = growth,
                backoff: float = backoff) -> List[Observation]:
            rng = random.Random(300 + hysteresis * 10 + interval)
            state = [torch.tensor([2.0**16], device=device), torch.zeros(1, dtype=torch.int32, device=device),
                     torch.tensor([hysteresis], dtype=torch.int32, device=device)]
            outputs = [torch.full((1,), 7.0, device=device), torch.full((1,), 7.0, device=device)]
            seen: List[Observation] = []
            for step in range(steps):
                found_inf = torch.tensor([float(rng.random() < 0.4) * rng.choice([1.0, 3.0])], device=device)
                extras = (*bounds, *outputs) if bounds else ()
                op(*state, found_inf, growth, backoff, interval, hysteresis, *extras)
                for name, t in zip(names[:3] + names[10:], state + (outputs if bounds else [])):
                    seen.append((f"step {step}: {name}", t.clone(), True))
            return seen
        clamp = f", clamped to {bounds[0]}..{bounds[1]} with inv_scale/should_skip" if bounds else ""
        yield Case(f"{steps} steps, hysteresis {hysteresis}, growth_interval {interval}, "
                   f"factors {growth}/{backoff}{clamp}", run)

    def near_max() -> Tuple[Any, ...]:
        state = (torch.tensor([3e38], device=device), torch.zeros(1, dtype=torch.int32, device=device),
                 torch.ones(1, dtype=torch.int32, device=device))
        return (*state, torch.zeros(1, device=device), 2.0, 0.5, 1, 1)
    yield Case("growth that would overflow fp32", call("update_scale_hysteresis", near_max))


def _sgd_forms() -> List[Tuple[torch.dtype, ...]]:
    """Dtypes of [grads, weights, momentum_bufs(, model_copies)] that multi_tensor_sgd takes, and of
    [grads, bf16 weights, momentum_bufs, remainders] (int16); a model-copy form last."""
    same: List[Tuple[torch.dtype, ...]] = [(d, d, d) for d in DTYPES]
    remainders: List[Tuple[torch.dtype, ...]] = [(g, torch.bfloat16, torch.float32, torch.int16) for g in DTYPES]
    copies: List[Tuple[torch.dtype, ...]] = [(g, torch.float32, torch.float32, c)
                                             for g in DTYPES for c in LOW]
    return same + remainders + copies


def _adam_forms(remainders: bool = True) -> List[Tuple[torch.dtype, ...]]:
    """Dtypes of [grads, params, exp_avgs, exp_avg_sqs(, model_copies)] that multi_tensor_adam (and
    multi_tensor_lamb, without ``remainders``) takes, and adam's [grads, bf16 weights, exp_avgs,
    exp_avg_sqs, remainders]; a model-copy form last."""
    same: List[Tuple[torch.dtype, ...]] = [(d,) * 4 for d in DTYPES]
    mixed: List[Tuple[torch.dtype, ...]] = [(g, torch.float32, torch.float32, torch.float32) for g in LOW]
    stepped: List[Tuple[torch.dtype, ...]] = [(g, torch.bfloat16, torch.float32, torch.float32, torch.int16)
                                              for g in DTYPES] if remainders else []
    copies: List[Tuple[torch.dtype, ...]] = [(g, torch.float32, torch.float32, torch.float32, c)
                                             for g in DTYPES for c in LOW]
    return same + mixed + stepped + copies


def _optimizer_lists(gen: torch.Generator, sizes: Sequence[int], form: Sequence[torch.dtype],
                     device: torch.device, grad_scale: float,
                     positive: Sequence[int] = ()) -> List[List[torch.Tensor]]:
    lists = [_tensors(gen, sizes, form[0], device, scale=grad_scale)]
    for k, dtype in enumerate(form[1:], start=1):
        if dtype == torch.int16:  # remainders: any bits are some master; a tensor of their own each
            lists.append([torch.randint(-2**15, 2**15, (remainder.packed_numel(n),), generator=gen,
                                        dtype=torch.int16).to(device) for n in sizes])
            continue
        lists.append(_tensors(gen, sizes, dtype, device, shift=k, scale=0.1 if k > 1 else 1.0,
                              positive=k in positive))
    return lists


def _sgd_cases(device: torch.device, quick: bool) -> Iterator[Case]:
    op = "multi_tensor_sgd"
    # (wd, momentum, dampening, lr, nesterov, first_run, wd_after_momentum)
    configs = [(0.0, 0.0, 0.0, 0.1, False, False, False), (1e-2, 0.9, 0.1, 0.05, False, False, False),
               (1e-2, 0.9, 0.0, 0.05, True, True, False), (1e-3, 0.9, 0.0, 0.1, False, False, True)]
    for layout in _layouts(quick, many=50):
        forms = _sgd_forms() if layout in _main_layouts(quick) else [_sgd_forms()[-1]]
        chosen = configs if layout in _main_layouts(quick) else configs[1:2]
        for i, (form, config) in enumerate(_quick_subset(quick, [(f,) for f in forms], chosen)):
            def make(layout: Layout = layout, form: Tuple[torch.dtype, ...] = form,
                     config: Tuple[Any, ...] = config, seed: int = i) -> Tuple[Any, ...]:
                gen = torch.Generator().manual_seed(400 + seed)
                lists = _optimizer_lists(gen, layout.sizes, form, device, grad_scale=1024.0)
                return (layout.chunk, _flag(device), lists, *config, 2.0**-10)
            label = "/".join(dtype_name(d) for d in form)
            yield Case(f"[{label}], wd/momentum/dampening/lr/nesterov/first_run/wd_after={config}, "
                       f"{layout.label}", call(op, make))
    nine = _sizes(1, 9, CHUNK)

    def special(flag_value: int = 0, poison: Optional[Tuple[float, str]] = None,
                tensor_scale: bool = False) -> Callable[[], Tuple[Any, ...]]:
        def make() -> Tuple[Any, ...]:
            gen = torch.Generator().manual_seed(401)
            lists = _optimizer_lists(gen, nine, _sgd_forms()[-1], device, grad_scale=1024.0)
            if poison is not None:
                _poison(lists[0], poison[1], poison[0])
            scale: Any = torch.tensor([2.0**-10], device=device) if tensor_scale else 2.0**-10
            return (CHUNK, _flag(device, flag_value), lists, 1e-2, 0.9, 0.1, 0.05, False, False, False, scale)
        return make
    yield Case("a set flag writes nothing", call(op, special(flag_value=1)))
    yield Case("a device tensor as scale", call(op, special(tensor_scale=True)))
    for value, where in _quick_subset(quick, [(v,) for v in NON_FINITE], WHERE):
        yield Case(f"{value} at the {where} grad element (flag clear)",
                   call(op, special(poison=(value, where))))


def _moment_op_cases(op: str, device: torch.device, quick: bool, configs: List[Tuple[Any, ...]],
                     side_config: Tuple[Any, ...], seed: int, names: str,
                     special_args: Callable[[bool], Tuple[Any, ...]], tensors_label: str) -> Iterator[Case]:
    """The cases of an op on Adam's lists (adam, lamb): every dtype form with ``configs`` (the host
    arguments after the lists; an inv_scale of 2**-10 follows) on the main layouts, ``side_config``
    on the others; then a set flag, device tensors (``tensors_label``) and non-finite grads, with
    ``special_args(tensors)`` after the lists."""
    all_forms = _adam_forms(remainders=op == "multi_tensor_adam")  # lamb steps no remainders
    for layout in _layouts(quick, many=50):
        forms = all_forms if layout in _main_layouts(quick) else [all_forms[-1]]
        chosen = configs if layout in _main_layouts(quick) else [side_config]
        for i, (form, config) in enumerate(_quick_subset(quick, [(f,) for f in forms], chosen)):
            def make(layout: Layout = layout, form: Tuple[torch.dtype, ...] = form,
                     config: Tuple[Any, ...] = config, index: int = i) -> Tuple[Any, ...]:
                gen = torch.Generator().manual_seed(seed + index)
                lists = _optimizer_lists(gen, layout.sizes, form, device, grad_scale=1024.0, positive=(3,))
                return (layout.chunk, _flag(device), lists, *config, 2.0**-10)
            label = "/".join(dtype_name(d) for d in form)
            yield Case(f"[{label}], {names}={config}, {layout.label}", call(op, make))
    nine = _sizes(1, 9, CHUNK)

    def special(flag_value: int = 0, poison: Optional[Tuple[float, str]] = None,
                tensors: bool = False) -> Callable[[], Tuple[Any, ...]]:
        def make() -> Tuple[Any, ...]:
            gen = torch.Generator().manual_seed(seed + 1)
            lists = _optimizer_lists(gen, nine, all_forms[-1], device, grad_scale=1024.0, positive=(3,))
            if poison is not None:
                _poison(lists[0], poison[1], poison[0])
            return (CHUNK, _flag(device, flag_value), lists, *special_args(tensors))
        return make
    yield Case("a set flag writes nothing", call(op, special(flag_value=1)))
    yield Case(f"device tensors as {tensors_label}", call(op, special(tensors=True)))
    for value, where in _quick_subset(quick, [(v,) for v in NON_FINITE], WHERE):
        yield Case(f"{value} at the {where} grad element (flag clear)",
                   call(op, special(poison=(value, where))))


def _adam_cases(device: torch.device, quick: bool) -> Iterator[Case]:
    # (lr, beta1, beta2, eps, step, mode, bias_correction, weight_decay)
    configs: List[Tuple[Any, ...]] = [
        (1e-3, 0.9, 0.999, 1e-8, 1, 0, 1, 0.0), (1e-2, 0.3, 0.99, 1e-8, 7, 0, 1, 1e-2),
        (1e-3, 0.9, 0.999, 1e-8, 1000, 1, 1, 1e-2), (1e-2, 0.0, 0.9, 1e-6, 3, 1, 0, 0.1),
    ]

    def special_args(tensors: bool) -> Tuple[Any, ...]:
        step: Any = torch.tensor([5], dtype=torch.int64, device=device) if tensors else 5
        scale: Any = torch.tensor([2.0**-10], device=device) if tensors else 2.0**-10
        return (1e-3, 0.9, 0.999, 1e-8, step, 1, 1, 1e-2, scale)
    return _moment_op_cases("multi_tensor_adam", device, quick, configs, configs[2], 500,
                            "lr/beta1/beta2/eps/step/mode/bias_correction/wd", special_args,
                            "step and inv_scale")


def _lamb_cases(device: torch.device, quick: bool) -> Iterator[Case]:
    # (lr, beta1, beta2, eps, step, bias_correction, weight_decay, grad_averaging, mode,
    #  global_grad_norm, max_grad_norm, use_nvlamb): clipped or not, L2 / decoupled, NVLAMB.
    configs: List[Tuple[Any, ...]] = [
        (1e-3, 0.9, 0.999, 1e-6, 1, 1, 0.01, 1, 1, 3.0, 1.0, False),
        (1e-2, 0.3, 0.99, 1e-8, 7, 1, 0.01, 0, 0, 0.5, 1.0, None),
        (1e-3, 0.9, 0.999, 1e-6, 1000, 0, 0.0, 1, 1, 2.0, 4.0, True),
        (1e-2, 0.0, 0.9, 1e-6, 3, 1, 0.0, 1, 0, 10.0, 1.0, False),
    ]

    def special_args(tensors: bool) -> Tuple[Any, ...]:
        norm: Any = torch.tensor([3.0], device=device) if tensors else 3.0
        scale: Any = torch.tensor([2.0**-10], device=device) if tensors else 2.0**-10
        return (1e-3, 0.9, 0.999, 1e-6, 5, 1, 0.01, 1, 1, norm, 1.0, False, scale)
    return _moment_op_cases("multi_tensor_lamb", device, quick, configs, configs[0], 600,
                            "lr/beta1/beta2/eps/step/bias_correction/wd/grad_averaging/mode/global_norm/"
                            "max_norm/nvlamb", special_args, "global_grad_norm and inv_scale")


def cases(op: str, device: torch.device, quick: bool) -> Iterator[Case]:
    if op == "multi_tensor_scale":
        return _scale_cases(device, quick)
    if op == "multi_tensor_axpby":
        return _axpby_cases(device, quick)
    if op in ("multi_tensor_l2norm", "multi_tensor_l2norm_mp", "multi_tensor_unscale_l2norm"):
        return _norm_cases(op, device, quick)
    if op == "update_scale_hysteresis":
        return _hysteresis_cases(device, quick)
    if op == "multi_tensor_sgd":
        return _sgd_cases(device, quick)
    if op == "multi_tensor_adam":
        return _adam_cases(device, quick)
    if op == "multi_tensor_lamb":
        return _lamb_cases(device, quick)
    raise ValueError(f"amp.check has no self-test for {op}")
