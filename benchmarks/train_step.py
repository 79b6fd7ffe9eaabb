"""Whole training steps: amp O1/O2/O5 vs torch.autocast (+ GradScaler for fp16) vs plain fp32.

Every configuration is rebuilt and timed once per round and the rounds are interleaved, so slow
drifts of a noisy machine hit all of them alike; medians are printed. Besides the step time the
table gives each step's overhead: the time from the end of backward to the end of the step
(unscaling, the overflow check, the optimizer step, the master->model copy; GradScaler's
step and update), measured inside the same steps, which is what amp and GradScaler actually
compete on. On CUDA the steps are timed with CUDA events (no synchronisation inside a step) and
the table adds each configuration's peak memory: the most allocated during its timed steps, over
what was allocated before it was built. amp's rows are compared with torch's of the same dtype
(autocast + GradScaler for fp16, autocast for bf16). ``--json`` also writes the medians to a file
(``tools/gpu_check.sh`` reads it).

    python benchmarks/train_step.py                 # CPU
    python benchmarks/train_step.py --device cuda --size large --json train_step.json
"""
import argparse
import gc
import json
import math
import statistics
import time

import torch
from torch import nn

import amp


class GPTBlock(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=512, width=128, heads=4, layers=2, seq=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(seq, width))
        self.blocks = nn.Sequential(*[GPTBlock(width, heads) for _ in range(layers)])
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens) + self.pos))


def small_cnn():
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


# size -> (GPT: vocab, width, heads, layers, sequence, batch; CNN: batch). "large" keeps a GPU
# busy enough that the steps are not bound by kernel launches.
SIZES = {
    "small": dict(gpt=(512, 128, 4, 2, 64, 8), cnn=32),
    "large": dict(gpt=(8192, 1024, 16, 8, 256, 16), cnn=256),
    # Many parameters (21M) and few tokens: the step after backward, which moves bytes per
    # parameter, weighs as it does on a GPU, where the matmuls are fast.
    "wide": dict(gpt=(8192, 512, 8, 4, 8, 1), cnn=8),
}


def workload(name, size, device):
    generator = torch.Generator().manual_seed(0)
    if name == "gpt":
        vocab, width, heads, layers, seq, batch = SIZES[size]["gpt"]
        tokens = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
        return (lambda: TinyGPT(vocab, width, heads, layers, seq)), tokens, tokens
    batch = SIZES[size]["cnn"]
    images = torch.randn(batch, 3, 32, 32, generator=generator).to(device)
    return small_cnn, images, torch.randint(0, 10, (batch,), generator=generator).to(device)


def loss_fn(output, target):
    return nn.functional.cross_entropy(output.float().flatten(0, -2), target.flatten())


# name -> (kind, dtype): kind is "fp32", "autocast" or an amp opt level.
CONFIGS = {
    "fp32": ("fp32", torch.float32),
    "autocast fp16 + GradScaler": ("autocast", torch.float16),
    "amp O1 (fp16)": ("O1", torch.float16),
    "amp O2 (fp16)": ("O2", torch.float16),
    "amp O2 + FusedAdam (fp16)": ("O2", torch.float16),
    "amp O2 + FusedAdam, model grads": ("O2", torch.float16),
    "autocast bf16": ("autocast", torch.bfloat16),
    "amp O5 (bf16)": ("O5", torch.bfloat16),
    "amp O5 + FusedAdam (bf16)": ("O5", torch.bfloat16),
    "amp O5 + FusedAdam, model grads": ("O5", torch.bfloat16),
    "amp O5 + FusedAdam, remainders": ("O5", torch.bfloat16),
}
# Configurations stepped by amp.optimizers.FusedAdam instead of torch's AdamW, with its options.
FUSED_ADAM = {
    "amp O2 + FusedAdam (fp16)": {},
    "amp O2 + FusedAdam, model grads": dict(materialize_master_grads=False),
    "amp O5 + FusedAdam (bf16)": {},
    "amp O5 + FusedAdam, model grads": dict(materialize_master_grads=False),
    "amp O5 + FusedAdam, remainders": dict(materialize_master_grads=False),
}
# amp.initialize options beyond the opt level.
AMP_OPTIONS = {"amp O5 + FusedAdam, remainders": dict(master_weights="remainder")}
# Bytes each configuration's post-backward work moves per parameter (reads + writes), counted from
# the passes it makes: unscale fp16 -> fp32 master grads (2 + 4), fused AdamW on fp32 (read p, g,
# m, v: 16; write p, m, v: 12), master -> model copy (4 + 2); GradScaler's check-and-unscale of
# the fp32 grads in place (4 + 4) and torch's fused AdamW writing the unscaled grad back (4);
# FusedAdam's pass, which also writes the model copy (from fp32 master grads: read 16, write 14;
# with model grads: read g16, p, m, v: 14, write 14, after a read-only overflow check (2) that a
# static scale (O5) skips); with remainders the master is read and written as a bf16 weight plus
# 2.125 bytes (read g, w, remainders, m, v: 14.125; write w, remainders, m, v: 12.125).
BYTES_PER_PARAM = {
    "fp32": 28, "autocast fp16 + GradScaler": 8 + 32, "amp O1 (fp16)": 8 + 28, "amp O2 (fp16)": 6 + 28 + 6,
    "amp O2 + FusedAdam (fp16)": 6 + 30, "amp O2 + FusedAdam, model grads": 2 + 28,
    "autocast bf16": 28, "amp O5 (bf16)": 6 + 28 + 6, "amp O5 + FusedAdam (bf16)": 6 + 30,
    "amp O5 + FusedAdam, model grads": 28, "amp O5 + FusedAdam, remainders": 26.25,
}


def build(config, model_fn, device, fused):
    kind, dtype = CONFIGS[config]
    torch.manual_seed(0)
    with device:  # initialised where it trains: a large model's CPU init would dominate the run
        model = model_fn()
    if config in FUSED_ADAM:
        optimizer = amp.optimizers.FusedAdam(model.parameters(), lr=1e-4, **FUSED_ADAM[config])
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    if kind.startswith("O"):
        model, optimizer = amp.initialize(model, optimizer, opt_level=kind, verbosity=0,
                                          **AMP_OPTIONS.get(config, {}))
    return kind, dtype, model, optimizer


def mark(device):
    """A point on the device's timeline: a recorded CUDA event (no sync), else the host clock."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def seconds_between(start, end):
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1e3  # the caller has synchronised


def make_step(kind, dtype, model, optimizer, device):
    """A closure running one training step; it returns marks at its start, the end of backward
    and its end."""
    scaler = torch.amp.GradScaler(device.type) if kind == "autocast" and dtype == torch.float16 else None

    def step(x, y):
        start = mark(device)
        optimizer.zero_grad(set_to_none=True)
        if kind == "autocast":
            with torch.autocast(device.type, dtype=dtype):
                loss = loss_fn(model(x), y)
        else:
            loss = loss_fn(model(x), y)
        if kind.startswith("O"):
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
                after_backward = mark(device)
            optimizer.step()
        elif scaler is not None:
            scaler.scale(loss).backward()
            after_backward = mark(device)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            after_backward = mark(device)
            optimizer.step()
        return start, after_backward, mark(device)
    return step


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, x, y, steps, warmup, device, baseline):
    """Median step time and overhead (s), and peak memory (MiB) over ``baseline`` bytes."""
    for _ in range(warmup):
        step(x, y)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    marks = [step(x, y) for _ in range(steps)]
    synchronize(device)
    times = [seconds_between(start, end) for start, _, end in marks]
    overheads = [seconds_between(after_backward, end) for _, after_backward, end in marks]
    peak = (torch.cuda.max_memory_allocated() - baseline) / 2**20 if device.type == "cuda" else math.nan
    return statistics.median(times), statistics.median(overheads), peak


def allocated(device):
    """Bytes allocated before a configuration is built, once the previous one is collected."""
    gc.collect()
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


def run(workload_name, args, device):
    model_fn, x, y = workload(workload_name, args.size, device)
    results = {name: {"step": [], "overhead": [], "peak": [], "master_grads": []} for name in CONFIGS}
    for round_index in range(args.rounds):
        for name in CONFIGS:
            model = optimizer = step = None  # let the previous configuration be collected
            baseline = allocated(device)
            kind, dtype, model, optimizer = build(name, model_fn, device, args.fused)
            step = make_step(kind, dtype, model, optimizer, device)
            measured = time_steps(step, x, y, args.steps, args.warmup, device, baseline)
            for key, value in zip(("step", "overhead", "peak"), measured):
                results[name][key].append(value)
            results[name]["master_grads"].append(master_grad_mib(optimizer))
        print(f"  [{workload_name}] round {round_index + 1}/{args.rounds} done", flush=True)
    return {name: {key: statistics.median(values) for key, values in r.items()}
            for name, r in results.items()}


def master_grad_mib(optimizer):
    """MiB of fp32 master gradients amp keeps for ``optimizer`` (allocated once, held between steps)."""
    stash = getattr(optimizer, "_amp_stash", None)
    buffers = [b for b in getattr(stash, "master_grad_buffers", []) if b is not None]
    return sum(b.numel() * b.element_size() for b in buffers) / 2**20


def print_traffic(workload_name, table):
    """Bytes per parameter moved after backward, and the fp32 master grads held, per configuration."""
    print(f"\n{workload_name}: post-backward traffic and master grads")
    print(f"{'config':34} {'B/param':>8} {'master grads MiB':>17} {'overhead vs torch':>18}")
    for name, row in table.items():
        kind, dtype = CONFIGS[name]
        versus = ""
        if kind.startswith("O"):
            versus = f"{row['overhead'] / table[torch_counterpart(dtype)]['overhead']:.2f}x"
        print(f"{name:34} {BYTES_PER_PARAM[name]:8g} {row['master_grads']:17.2f} {versus:>18}")


def torch_counterpart(dtype):
    """The torch configuration amp's of this dtype is measured against."""
    return "autocast fp16 + GradScaler" if dtype == torch.float16 else "autocast bf16"


def print_table(workload_name, table):
    print(f"\n{workload_name}: medians over rounds (ms per step, MiB)")
    print(f"{'config':34} {'step':>9} {'overhead':>9} {'step/fp32':>10} {'peak MiB':>9}   "
          f"{'vs torch: step / overhead / peak':>34}")
    fp32_step = table["fp32"]["step"]
    for name, row in table.items():
        kind, dtype = CONFIGS[name]
        versus = ""
        if kind.startswith("O"):
            torch_row = table[torch_counterpart(dtype)]
            peak = f"{row['peak'] / torch_row['peak']:.2f}x" if torch_row["peak"] > 0 else "-"
            versus = (f"{row['step'] / torch_row['step']:.2f}x / "
                      f"{row['overhead'] / torch_row['overhead']:.2f}x / {peak}")
        print(f"{name:34} {row['step'] * 1e3:9.2f} {row['overhead'] * 1e3:9.2f} "
              f"{row['step'] / fp32_step:10.2f} {row['peak']:9.1f}   {versus:>34}")
    print("overhead = end of backward to end of step. vs torch = amp's / the torch config's of the "
          "same dtype (autocast+GradScaler for fp16, autocast for bf16); peak memory on CUDA only.")


def write_json(path, device, args, tables):
    """Medians in ms and MiB (peak null off CUDA), per workload and configuration."""
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "amp_C": amp.multi_tensor_apply.multi_tensor_applier.available,
        "size": args.size,
        "workloads": {
            workload_name: {
                name: {"step_ms": row["step"] * 1e3, "overhead_ms": row["overhead"] * 1e3,
                       "peak_mib": None if math.isnan(row["peak"]) else row["peak"]}
                for name, row in table.items()}
            for workload_name, table in tables.items()},
    }
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def has_fused_adamw(device):
    """Whether this torch steps ``AdamW(fused=True)`` on ``device`` (on the CPU from torch 2.4)."""
    param = torch.zeros(1, device=device, requires_grad=True)
    param.grad = torch.zeros_like(param)
    try:
        torch.optim.AdamW([param], fused=True).step()
    except RuntimeError:
        return False
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--workload", choices=["gpt", "cnn", "both"], default="both")
    parser.add_argument("--size", choices=list(SIZES), default="small",
                        help="model and batch size (default: small; wide: 21M parameters, few tokens,"
                             " so that the post-backward step weighs as on a GPU; large is for a GPU)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved repetitions")
    parser.add_argument("--no-fused", dest="fused", action="store_false",
                        help="use the for-loop AdamW instead of fused=True")
    parser.add_argument("--json", metavar="PATH", help="also write the medians to this JSON file")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU")
    if args.fused and not has_fused_adamw(device):
        print(f"torch {torch.__version__} has no fused AdamW on {device.type}: using the for-loop one")
        args.fused = False
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} "
          f"size={args.size} fused AdamW={args.fused} "
          f"amp_C={amp.multi_tensor_apply.multi_tensor_applier.available}")
    names = ["gpt", "cnn"] if args.workload == "both" else [args.workload]
    tables = {}
    for name in names:
        tables[name] = run(name, args, device)
        print_table(name, tables[name])
        print_traffic(name, tables[name])
    if args.json:
        write_json(args.json, device, args, tables)


if __name__ == "__main__":
    main()
