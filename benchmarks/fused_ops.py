"""The fused optimizer kernels (amp_C.multi_tensor_sgd / multi_tensor_adam / multi_tensor_lamb) against
the limit and the fallback.

Side by side in one process, interleaved repetitions, medians, over the GPT-ish parameter list of
benchmarks/unscale.py. For each op and dtype form it prints the bytes the kernel must move per
parameter (grads, weights and state read once; everything but the grads written once; lamb's two
passes also write its fp32 updates, read the params and updates for their norms, and read both again
in the second pass), its time against a plain copy of
the same bytes on the same device (one fp32 ``copy_`` of bytes/8 elements per parameter: the
fraction of the copy limit, goal >= 0.8), and against the pure-PyTorch fallback of
amp._pytorch_ops (what runs without amp_C).

Usage: python benchmarks/fused_ops.py [--device cuda] [--reps 15] [--fallback-reps 3]
"""
import argparse
import statistics

import torch

from unscale import CHUNK, gpt_ish_shapes

import amp_C
from amp import _pytorch_ops
from amp.check.timing import seconds_per_call

# (op, grad dtype, weight/state dtype, model-copy dtype or None), the forms amp's optimizers use.
FORMS = [
    ("sgd", torch.float32, torch.float32, None),
    ("sgd", torch.float16, torch.float32, torch.float16),
    ("sgd", torch.bfloat16, torch.float32, torch.bfloat16),
    ("adam", torch.float32, torch.float32, None),
    ("adam", torch.float16, torch.float32, torch.float16),
    ("adam", torch.bfloat16, torch.float32, torch.bfloat16),
    ("lamb", torch.float32, torch.float32, None),
    ("lamb", torch.float16, torch.float32, torch.float16),
    ("lamb", torch.bfloat16, torch.float32, torch.bfloat16),
]


def form_name(form):
    op, grad, weight, copy = (str(d).replace("torch.", "") if d is not None else d for d in form)
    return f"{op}: {grad} grads, {weight} {'params+state'}" + (f", {copy} model copy" if copy else "")


def make_lists(form, shapes, device):
    gen = torch.Generator().manual_seed(0)
    op, grad_dtype, weight_dtype, copy_dtype = form
    weights = [torch.randn(s, generator=gen).to(device, weight_dtype) for s in shapes]
    lists = [[(w.float() * 0.01).to(grad_dtype) for w in weights], weights]
    lists += [[torch.zeros_like(w) for w in weights] for _ in range(1 if op == "sgd" else 2)]
    if copy_dtype is not None:
        lists.append([w.to(copy_dtype) for w in weights])
    return lists


def bytes_per_param(form, lists):
    """Per element: reads of the grads, weights and state; writes of everything but the grads (the
    model copy is only written)."""
    sizes = [tensors[0].element_size() for tensors in lists]
    read = sizes[:-1] if form[3] is not None else sizes
    once = sum(read) + sum(sizes[1:])
    if form[0] == "lamb":  # the fp32 updates: written, read twice; the params: read twice more
        return once + 3 * 4 + 2 * sizes[1]
    return once


def step(impl, form, lists, flag):
    if form[0] == "sgd":
        impl.multi_tensor_sgd(CHUNK, flag, lists, 1e-4, 0.9, 0.0, 0.1, False, False, False, 1 / 1024)
    elif form[0] == "adam":
        impl.multi_tensor_adam(CHUNK, flag, lists, 1e-3, 0.9, 0.999, 1e-8, 10, 1, 1, 1e-2, 1 / 1024)
    else:
        impl.multi_tensor_lamb(CHUNK, flag, lists, 1e-3, 0.9, 0.999, 1e-6, 10, 1, 1e-2, 1, 1, 3.0, 1.0,
                               False, 1 / 1024)


def medians(candidates, reps, device):
    """Median seconds per call of each candidate, the candidates interleaved within a repetition."""
    times = {label: [] for label in candidates}
    for fn in candidates.values():  # warm-up
        fn()
    for _ in range(reps):
        for label, fn in candidates.items():
            if len(times[label]) < fn.reps:
                times[label].append(seconds_per_call(fn, device))
    return {label: statistics.median(t) for label, t in times.items()}


class Candidate:
    def __init__(self, fn, reps):
        self.fn, self.reps = fn, reps

    def __call__(self):
        self.fn()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--fallback-reps", type=int, default=3,
                        help="repetitions of the (slow) fallback, interleaved with the first ones")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not amp_C.cuda_available():
        raise SystemExit("amp_C has no CUDA support here (build with AMP_CUDA_EXT=1 on a GPU machine)")
    shapes = gpt_ish_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(f"{len(shapes)} tensors, {numel / 1e6:.1f}M params, device {device}, "
          f"{torch.get_num_threads()} CPU threads, median of {args.reps} "
          f"(fallback: {args.fallback_reps})")
    print(f"{'op and form':<62} {'B/param':>7} {'kernel ms':>9} {'copy ms':>8} "
          f"{'of copy':>7} {'fallback ms':>11} {'speed-up':>8}")
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    for form in FORMS:
        lists = make_lists(form, shapes, device)
        fallback_lists = make_lists(form, shapes, device)
        nbytes = bytes_per_param(form, lists)
        # A copy that reads and writes nbytes per param in total: fp32, nbytes / 8 elements each.
        src = torch.randn(numel * nbytes // 8, device=device)
        dst = torch.empty_like(src)
        result = medians({
            "kernel": Candidate(lambda: step(amp_C, form, lists, flag), args.reps),
            "copy": Candidate(lambda: dst.copy_(src), args.reps),
            "fallback": Candidate(lambda: step(_pytorch_ops, form, fallback_lists, flag),
                                  args.fallback_reps),
        }, args.reps, device)
        kernel, copy, fallback = result["kernel"], result["copy"], result["fallback"]
        print(f"{form_name(form):<62} {nbytes:>7} {kernel * 1e3:>9.2f} {copy * 1e3:>8.2f} "
              f"{copy / kernel:>7.2f} {fallback * 1e3:>11.1f} {fallback / kernel:>7.1f}x")
    print("goal: the kernel at >= 0.8 of the copy of the same bytes")


if __name__ == "__main__":
    main()
