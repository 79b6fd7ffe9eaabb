"""Per-rank memory and step time of amp O2 with FSDP2 (fully_shard) vs DDP, on 2 CPU ranks (gloo).

Each setup runs in its own pair of processes (so that each has its own peak RSS): the same MLP
(``--layers`` Linear(width, width), about 52M parameters by default), Adam, amp O2, the same
per-rank batches. Printed per rank: the bytes of the tensors the rank holds for training
(parameters, grads, fp32 masters and their grads, Adam state; each storage counted once, a
DTensor by its local shard), measured right after ``scale_loss`` (every grad exists) at the
last step; the process's peak RSS; and the median step time, with the FSDP2/DDP ratio.

    python benchmarks/fsdp_memory.py
    python benchmarks/fsdp_memory.py --width 256 --layers 2 --steps 2   # a quick look
"""
import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import amp
from amp._compat import fsdp2, local_tensor

WORLD = 2


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build(args):
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    return nn.Sequential(*layers)


def held_bytes(model, optimizer):
    """Bytes of the distinct storages behind params, grads, masters, master grads, optimizer state."""
    tensors = []
    for param in list(model.parameters()) + list(amp.master_params(optimizer)):
        tensors += [param, param.grad]
    for state in optimizer.state.values():
        tensors += [value for value in state.values() if torch.is_tensor(value)]
    storages = {}
    for tensor in tensors:
        if tensor is not None:
            storage = local_tensor(tensor).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def worker(rank, setup, args, port, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    model = build(args)
    if setup == "fsdp2":
        for layer in model:
            if isinstance(layer, nn.Linear):
                fsdp2()[0](layer)
        fsdp2()[0](model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    if setup == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    times, held = [], 0
    for step in range(args.warmup + args.steps):
        inputs = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(step + 10 * rank))
        start = time.perf_counter()
        loss = model(inputs).float().pow(2).mean()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        held = held_bytes(model, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    result = dict(params=sum(p.numel() for p in model.parameters()), held=held,
                  rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  step_s=statistics.median(times))
    dist.barrier()
    dist.destroy_process_group()
    with open(f"{out}/{setup}{rank}.json", "w") as file:
        json.dump(result, file)
    sys.stdout.flush()
    os._exit(0)  # as in tests/test_distributed.py: gloo threads may abort a finished teardown


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=2560)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="rows per rank")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if fsdp2() is None:
        sys.exit(f"torch {torch.__version__} has no FSDP2 (fully_shard)")
    results = {}
    with tempfile.TemporaryDirectory() as out:
        for setup in ("ddp", "fsdp2"):
            mp.spawn(worker, args=(setup, args, free_port(), out), nprocs=WORLD, join=True)
            results[setup] = [json.load(open(f"{out}/{setup}{rank}.json")) for rank in range(WORLD)]
    mib = 2.0**20
    print(f"amp O2, Adam, {results['ddp'][0]['params'] / 1e6:.1f}M parameters, {WORLD} CPU ranks (gloo), "
          f"batch {args.batch} per rank, medians of {args.steps} steps")
    print(f"{'setup':<7}{'rank':>5}{'held MiB':>10}{'peak RSS MiB':>14}{'step s':>9}")
    for setup, ranks in results.items():
        for rank, result in enumerate(ranks):
            print(f"{setup:<7}{rank:>5}{result['held'] / mib:>10.1f}{result['rss'] / mib:>14.1f}"
                  f"{result['step_s']:>9.3f}")
    for rank in range(WORLD):
        held = results["fsdp2"][rank]["held"] / results["ddp"][rank]["held"]
        rss = results["fsdp2"][rank]["rss"] / results["ddp"][rank]["rss"]
        step = results["fsdp2"][rank]["step_s"] / results["ddp"][rank]["step_s"]
        print(f"rank {rank}: FSDP2/DDP held bytes {held:.2f}, peak RSS {rss:.2f}, step time {step:.2f}")


if __name__ == "__main__":
    main()
