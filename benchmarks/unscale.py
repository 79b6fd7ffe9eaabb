"""Unscaling fp16 gradients into fp32 master gradients: amp_C against what torch users write.

Side by side in one process, interleaved repetitions, medians. Over a GPT-ish parameter list
(~27M elements: a few large matrices, many small vectors) it times:

* unscale: fp16 grads -> fp32 master grads times 1/scale, with the overflow check:
  amp_C.multi_tensor_scale (one pass) vs (a) `_foreach_copy_` then
  `torch._amp_foreach_non_finite_check_and_unscale_` (what a torch user writes) vs (b) a plain
  `_foreach_copy_` fp16 -> fp32 of the same bytes (the limit: no arithmetic, no check);
* l2norm of the fp32 master grads: amp_C.multi_tensor_l2norm vs `_foreach_norm` + `vector_norm`;
* master -> model copy (fp32 -> fp16, scale 1.0) vs `_foreach_copy_`.

Usage: python benchmarks/unscale.py [--device cuda] [--reps 30]
"""
import argparse
import statistics

import torch

from amp.check.timing import seconds_per_call

try:
    import amp_C
except ImportError as err:
    raise SystemExit(f"benchmarks/unscale.py times the amp_C kernels, which did not import ({err}). "
                     "Build them first: AMP_CPP_EXT=1 python setup.py build_ext --inplace") from None

CHUNK = 2048 * 32


def gpt_ish_shapes(vocab=16000, width=512, layers=6):
    shapes = [(vocab, width), (1024, width)]  # token and position embeddings
    for _ in range(layers):
        shapes += [(width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,)]
        shapes += [(width,), (width,), (4 * width, width), (4 * width,), (width, 4 * width), (width,)]
    return shapes + [(width,), (width,)]


def compare(name, candidates, reps, device):
    """Runs each candidate once per repetition, in turn; prints medians and ratios to the first."""
    times = {label: [] for label in candidates}
    for fn in candidates.values():  # warm-up
        fn()
    for _ in range(reps):
        for label, fn in candidates.items():
            times[label].append(seconds_per_call(fn, device))
    medians = {label: statistics.median(t) for label, t in times.items()}
    ours = next(iter(medians.values()))
    print(f"\n{name}")
    for label, median in medians.items():
        print(f"  {label:<58} {median * 1e3:8.2f} ms   ours is {median / ours:5.2f}x faster")
    return medians


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not amp_C.cuda_available():
        raise SystemExit("amp_C has no CUDA support here (build with AMP_CUDA_EXT=1 on a GPU machine)")

    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(s, generator=gen).to(device) for s in gpt_ish_shapes()]
    grads16 = [(m * 1024).half() for m in masters]
    model16 = [m.half() for m in masters]
    master_grads = [torch.empty_like(m) for m in masters]
    numel = sum(m.numel() for m in masters)
    print(f"{len(masters)} tensors, {numel / 1e6:.1f}M elements, device {device}, "
          f"{torch.get_num_threads()} CPU threads, median of {args.reps}")

    flag = torch.zeros(1, dtype=torch.int32, device=device)
    found_inf = torch.zeros(1, device=device)
    inv_scale = torch.full((1,), 1 / 1024, device=device)

    def amp_C_unscale():
        amp_C.multi_tensor_scale(CHUNK, flag, [grads16, master_grads], inv_scale)

    def torch_copy_then_unscale():
        torch._foreach_copy_(master_grads, grads16)
        torch._amp_foreach_non_finite_check_and_unscale_(master_grads, found_inf, inv_scale)

    def plain_copy():
        torch._foreach_copy_(master_grads, grads16)

    unscale = compare(
        "unscale fp16 grads -> fp32 master grads, with overflow check",
        {"amp_C.multi_tensor_scale": amp_C_unscale,
         "(a) _foreach_copy_ + _amp_foreach_non_finite_check_and_unscale_": torch_copy_then_unscale,
         "(b) _foreach_copy_ fp16 -> fp32 (same bytes, no math)": plain_copy},
        args.reps, device)
    labels = list(unscale)
    copy_goal = 0.85 if device.type == "cuda" else 0.8
    print(f"  speed-up over (a): {unscale[labels[1]] / unscale[labels[0]]:.2f}x (goal >= 1.5); "
          f"fraction of the copy limit (b): {unscale[labels[2]] / unscale[labels[0]]:.2f} "
          f"(goal >= {copy_goal})")

    compare(
        "L2 norm of the fp32 master grads",
        {"amp_C.multi_tensor_l2norm": lambda: amp_C.multi_tensor_l2norm(CHUNK, flag, [master_grads]),
         "_foreach_norm + linalg.vector_norm": lambda: torch.linalg.vector_norm(
             torch.stack(torch._foreach_norm(master_grads)))},
        args.reps, device)

    compare(
        "master -> model copy, fp32 -> fp16",
        {"amp_C.multi_tensor_scale (scale 1.0)": lambda: amp_C.multi_tensor_scale(
            CHUNK, flag, [masters, model16], 1.0),
         "_foreach_copy_": lambda: torch._foreach_copy_(model16, masters)},
        args.reps, device)


if __name__ == "__main__":
    main()
