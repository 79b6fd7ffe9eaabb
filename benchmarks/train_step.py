"""Whole training steps: amp O1/O2/O5 vs torch.autocast (+ GradScaler for fp16) vs plain fp32.

Every configuration is rebuilt and timed once per round and the rounds are interleaved, so slow
drifts of a noisy machine hit all of them alike; medians are printed. Besides the step time the
table gives each step's overhead: the time from the end of backward to the end of the step
(unscaling, the overflow check, the optimizer step, the master->model copy; GradScaler's
step and update), measured inside the same steps, which is what amp and GradScaler actually
compete on. Peak memory is measured on CUDA only.

    python benchmarks/train_step.py                 # CPU
    python benchmarks/train_step.py --device cuda --steps 50
"""
import argparse
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


def workload(name, device):
    generator = torch.Generator().manual_seed(0)
    if name == "gpt":
        tokens = torch.randint(0, 512, (8, 64), generator=generator).to(device)
        return TinyGPT, tokens, tokens
    images = torch.randn(32, 3, 32, 32, generator=generator).to(device)
    return small_cnn, images, torch.randint(0, 10, (32,), generator=generator).to(device)


def loss_fn(output, target):
    return nn.functional.cross_entropy(output.float().flatten(0, -2), target.flatten())


# name -> (kind, dtype): kind is "fp32", "autocast" or an amp opt level.
CONFIGS = {
    "fp32": ("fp32", torch.float32),
    "autocast fp16 + GradScaler": ("autocast", torch.float16),
    "amp O1 (fp16)": ("O1", torch.float16),
    "amp O2 (fp16)": ("O2", torch.float16),
    "autocast bf16": ("autocast", torch.bfloat16),
    "amp O5 (bf16)": ("O5", torch.bfloat16),
}


def build(config, model_fn, device, fused):
    kind, dtype = CONFIGS[config]
    torch.manual_seed(0)
    model = model_fn().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    if kind.startswith("O"):
        model, optimizer = amp.initialize(model, optimizer, opt_level=kind, verbosity=0)
    return kind, dtype, model, optimizer


def make_step(kind, dtype, model, optimizer, device):
    """A closure running one training step; it returns the seconds spent after backward."""
    scaler = torch.amp.GradScaler(device.type) if kind == "autocast" and dtype == torch.float16 else None

    def backward_done():
        synchronize(device)
        return time.perf_counter()

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        if kind == "autocast":
            with torch.autocast(device.type, dtype=dtype):
                loss = loss_fn(model(x), y)
        else:
            loss = loss_fn(model(x), y)
        if kind.startswith("O"):
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
                after_backward = backward_done()
            optimizer.step()
        elif scaler is not None:
            scaler.scale(loss).backward()
            after_backward = backward_done()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            after_backward = backward_done()
            optimizer.step()
        synchronize(device)
        return time.perf_counter() - after_backward
    return step


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, x, y, steps, warmup, device):
    for _ in range(warmup):
        step(x, y)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, overheads = [], []
    for _ in range(steps):
        start = time.perf_counter()
        overheads.append(step(x, y))
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    return statistics.median(times), statistics.median(overheads), peak


def run(workload_name, args, device):
    model_fn, x, y = workload(workload_name, device)
    results = {name: {"step": [], "overhead": [], "peak": []} for name in CONFIGS}
    for round_index in range(args.rounds):
        for name in CONFIGS:
            kind, dtype, model, optimizer = build(name, model_fn, device, args.fused)
            step = make_step(kind, dtype, model, optimizer, device)
            measured = time_steps(step, x, y, args.steps, args.warmup, device)
            for key, value in zip(("step", "overhead", "peak"), measured):
                results[name][key].append(value)
        print(f"  [{workload_name}] round {round_index + 1}/{args.rounds} done", flush=True)
    return {name: {key: statistics.median(values) for key, values in r.items()}
            for name, r in results.items()}


def print_table(workload_name, table):
    print(f"\n{workload_name}: medians over rounds (ms per step)")
    print(f"{'config':30} {'step':>9} {'overhead':>9} {'step/fp32':>10} "
          f"{'vs torch: overhead / step':>26} {'peak MiB':>9}")
    fp32_step = table["fp32"]["step"]
    for name, row in table.items():
        kind, dtype = CONFIGS[name]
        torch_name = "autocast fp16 + GradScaler" if dtype == torch.float16 else "autocast bf16"
        versus = ""
        if kind.startswith("O"):
            torch_row = table[torch_name]
            versus = (f"{row['overhead'] / torch_row['overhead']:.2f}x / "
                      f"{row['step'] / torch_row['step']:.2f}x")
        print(f"{name:30} {row['step'] * 1e3:9.2f} {row['overhead'] * 1e3:9.2f} "
              f"{row['step'] / fp32_step:10.2f} {versus:>26} {row['peak']:9.1f}")
    print("overhead = end of backward to end of step. vs torch = amp's / the torch config's of the "
          "same dtype (autocast+GradScaler for fp16, autocast for bf16).")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--workload", choices=["gpt", "cnn", "both"], default="both")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved repetitions")
    parser.add_argument("--no-fused", dest="fused", action="store_false",
                        help="use the for-loop AdamW instead of fused=True")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU")
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} "
          f"fused AdamW={args.fused} amp_C={amp.multi_tensor_apply.multi_tensor_applier.available}")
    names = ["gpt", "cnn"] if args.workload == "both" else [args.workload]
    for name in names:
        print_table(name, run(name, args, device))


if __name__ == "__main__":
    main()
