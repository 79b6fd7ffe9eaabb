"""Memory and post-backward time of O5 with ``master_weights="remainder"`` against fp32 masters
and against torch's own bf16 recipe (autocast + fp32 params + ``AdamW(fused=True)``).

Each setup trains the same MLP (``--layers`` Linear(width, width), 50M parameters by default) in
its own fresh process, so that each has its own peak RSS. Printed per setup: the bytes per
parameter of the tensors held for training (parameters, grads, fp32 masters or remainders,
optimizer state; each storage counted once), measured right after ``scale_loss`` at the last
step, when every grad exists; the bytes per parameter the step after backward moves (counted from
its passes, below); the process's peak RSS over its RSS before the model was built; and the
median time from the end of backward to the end of the step, with its ratio to torch's. The
processes run with ``MALLOC_MMAP_THRESHOLD_=65536``, so that glibc gives every large freed tensor
back at once and RSS follows the tensors alive (with its default, which rises to the largest size
freed so far, a setup that frees its fp32 model at ``initialize`` keeps those pages in its heap).

    python benchmarks/remainder_memory.py
    python benchmarks/remainder_memory.py --width 512 --layers 2 --steps 3   # a quick look
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

import amp

SETUPS = {
    "autocast bf16 + AdamW(fused=True)": None,
    "amp O5 + FusedAdam, fp32 masters": True,
    "amp O5 + FusedAdam, remainders": "remainder",
}
# glibc's malloc, told to return every freed block of 64 KiB or more to the system at once.
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "65536"}
# Bytes per parameter the step after backward reads and writes. torch: AdamW's fused pass over
# fp32 params (read p, g, m, v: 16; write p, m, v: 12). amp with model grads (no fp32 master
# grads): FusedAdam reads the bf16 grad and the fp32 master (2 + 4) or the bf16 weight and the
# remainders (2 + 2.125), m and v (8), and writes the master (or remainders) and bf16 weight, m, v.
MOVED_PER_PARAM = {
    "autocast bf16 + AdamW(fused=True)": 16 + 12,
    "amp O5 + FusedAdam, fp32 masters": (2 + 4 + 8) + (4 + 2 + 8),
    "amp O5 + FusedAdam, remainders": (2 + 2 + 2.125 + 8) + (2 + 2.125 + 8),
}


def build(args, master_weights):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    if master_weights is None:
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    optimizer = amp.optimizers.FusedAdam(model.parameters(), lr=1e-4, materialize_master_grads=False)
    return amp.initialize(model, optimizer, opt_level="O5", master_weights=master_weights, verbosity=0)


def held_bytes(model, optimizer):
    """Bytes of the tensors kept for training, each storage once (a remainder master has none of
    its own: its remainders are counted)."""
    tensors = list(model.parameters()) + [p.grad for p in model.parameters()]
    for group in optimizer.param_groups:
        for param in group["params"]:
            tensors += [getattr(param, "remainders", param), param.grad]
            tensors += [v for v in optimizer.state.get(param, {}).values() if isinstance(v, torch.Tensor)]
    seen, total = set(), 0
    for t in tensors:
        if t is None or type(t).__name__ in ("UnmadeGrad", "RemainderMaster"):
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(args, name):
    """One setup, in this process: held B/param, peak RSS MiB over the start, post-backward ms."""
    start_rss = rss_mib()
    model, optimizer = build(args, SETUPS[name])
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=generator)
    overheads, held = [], 0
    for step in range(args.warmup + args.steps):
        optimizer.zero_grad(set_to_none=True)
        if SETUPS[name] is None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
        else:
            with amp.scale_loss(model(x.bfloat16()).float().pow(2).mean(), optimizer) as scaled_loss:
                scaled_loss.backward()
        held = held_bytes(model, optimizer)
        begin = time.perf_counter()
        optimizer.step()
        if step >= args.warmup:
            overheads.append(time.perf_counter() - begin)
    params = sum(p.numel() for p in model.parameters())
    return dict(params=params, held=held / params, peak_rss=rss_mib() - start_rss,
                overhead=statistics.median(overheads))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--setup", help=argparse.SUPPRESS)  # run one setup, print JSON (internal)
    args = parser.parse_args()
    if args.setup is not None:
        print(json.dumps(measure(args, args.setup)))
        return
    forwarded = [f"--{key}={getattr(args, key)}" for key in ("width", "layers", "batch", "steps", "warmup")]
    results = {}
    for name in SETUPS:
        out = subprocess.run([sys.executable, __file__, *forwarded, f"--setup={name}"], check=True,
                             capture_output=True, text=True, env={**os.environ, **ALLOCATOR}).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
    torch_row = results["autocast bf16 + AdamW(fused=True)"]
    print(f"{torch_row['params'] / 1e6:.1f}M parameters, amp_C: "
          f"{amp.multi_tensor_apply.multi_tensor_applier.available}, torch {torch.__version__}")
    print(f"{'setup':36} {'held B/param':>12} {'moved B/param':>13} {'peak RSS MiB':>12} "
          f"{'post-backward ms':>16} {'vs torch':>8}")
    for name, row in results.items():
        print(f"{name:36} {row['held']:12.3f} {MOVED_PER_PARAM[name]:13.3f} {row['peak_rss']:12.0f} "
              f"{row['overhead'] * 1e3:16.2f} {row['overhead'] / torch_row['overhead']:7.2f}x")


if __name__ == "__main__":
    main()
