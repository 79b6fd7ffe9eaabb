"""Forward+backward time under the O1/O4 casting engine vs torch.autocast, same dtype.

Both run in one process, interleaved repetition by repetition, and the medians are compared:

    python -m benchmarks.o1_overhead                  # from the repo root; bf16 on CPU, fp16 on CUDA
    python -m benchmarks.o1_overhead --dtype fp16 bf16 --device cpu --profile

The engine's cost over autocast is the Python wrappers around every patched call (autocast
dispatches in C++); ``--profile`` shows where that time goes.
"""
import argparse
import cProfile
import pstats
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp.casting

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class TransformerBlock(nn.Module):
    def __init__(self, d=128, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = F.softmax(q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        layers, c = [], 3
        for width in (16, 32, 64):
            layers += [nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                       nn.MaxPool2d(2)]
            c = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(64 * 4 * 4, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def _cases(device):
    yield "transformer", TransformerBlock().to(device), torch.randn(4, 32, 128, device=device)
    # So small that per-call Python overhead, not the kernels, dominates: the worst case.
    yield "tiny-xfmr", TransformerBlock(32).to(device), torch.randn(2, 8, 32, device=device)
    yield "cnn", SmallCNN().to(device), torch.randn(4, 3, 32, 32, device=device)


def _step(model, x):
    out = model(x)
    out.float().pow(2).mean().backward()
    model.zero_grad(set_to_none=True)


def _time(fn, iters, device):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def run_engine(model, x, dtype, iters, device):
    handle = amp.casting.init(patch_type=dtype)
    try:
        def step():
            _step(model, x)
            handle.cache.clear()  # what amp.scale_loss does at exit
        return _time(step, iters, device)
    finally:
        amp.deactivate()


def run_autocast(model, x, dtype, iters, device):
    def step():
        with torch.autocast(device, dtype=dtype):
            out = model(x)
        out.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
    return _time(step, iters, device)


def profile_engine(model, x, dtype, iters):
    handle = amp.casting.init(patch_type=dtype)
    profiler = cProfile.Profile()
    try:
        profiler.enable()
        for _ in range(iters):
            _step(model, x)
            handle.cache.clear()
        profiler.disable()
    finally:
        amp.deactivate()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=None)
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    # One thread by default: on a shared or small CPU, OpenMP contention swamps the comparison.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = args.dtype or (["bf16"] if args.device == "cpu" else ["fp16"])
    print(f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__}")
    print(f"{'model':<12} {'dtype':<5} {'engine ms':>10} {'autocast ms':>12} {'ratio':>6}")
    for name, model, x in _cases(args.device):
        for key in dtypes:
            dtype = DTYPES[key]
            times = {"engine": [], "autocast": []}
            run_engine(model, x, dtype, 2, args.device)  # warm-up both paths
            run_autocast(model, x, dtype, 2, args.device)
            for _ in range(args.reps):
                times["engine"].append(run_engine(model, x, dtype, args.iters, args.device))
                times["autocast"].append(run_autocast(model, x, dtype, args.iters, args.device))
            engine, autocast = (statistics.median(times[k]) * 1e3 for k in ("engine", "autocast"))
            print(f"{name:<12} {key:<5} {engine:>10.2f} {autocast:>12.2f} {engine / autocast:>6.2f}")
            if args.profile:
                profile_engine(model, x, dtype, args.iters)


if __name__ == "__main__":
    main()
