"""DistributedDataParallel with amp: each process trains on its shard of the digits.

    torchrun --nproc_per_node=2 examples/distributed/train_ddp.py              # gloo on CPU
    torchrun --nproc_per_node=2 examples/distributed/train_ddp.py --opt-level O1

The amp lines are the same as in a single-process script. The one rule is the order: wrap the
model in DistributedDataParallel AFTER amp.initialize, so that DDP sees (and all-reduces the
gradients of) the parameters amp has already cast. All ranks then see the same all-reduced
gradients, find the same overflows and skip the same steps, so their weights stay identical; the
script checks that at the end.
"""
import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import amp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402  (examples/common.py, found through the line above)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, default_opt_level="O2")
    common.add_distributed_args(parser, lr=0.05)
    return common.parse_under_torchrun(parser, argv, "examples/distributed/train_ddp.py")


def build_model():
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def ranks_agree(tensors):
    """True when every rank holds bitwise the same values as rank 0 (checked on every rank)."""
    mismatch = torch.zeros(1, device=tensors[0].device)
    for tensor in tensors:
        reference = tensor.detach().clone()
        dist.broadcast(reference, src=0)
        if not torch.equal(reference, tensor.detach()):
            mismatch += 1
    dist.all_reduce(mismatch)  # SUM: any rank that differs makes it non-zero everywhere
    return mismatch.item() == 0


def main(argv=None):
    args = parse_args(argv)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            sys.exit(f"train_ddp.py: error: LOCAL_RANK {local_rank} needs a GPU of its own but there "
                     f"are {torch.cuda.device_count()}; use --nproc_per_node <= the GPU count, or "
                     "--device cpu")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend)
    code = train(args, rank, world_size, local_rank, device, backend)
    # Every DDP object of train() is gone now; the group goes once all ranks are here (gloo aborts
    # a process whose group is torn down while a peer is still connected, or at interpreter exit).
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return code


def train(args, rank, world_size, local_rank, device, backend):
    """Train this rank's shard; 0 when the ranks agree (and, with --smoke, the loss fell)."""
    common.seed_everything(args.seed)  # same init everywhere (DDP would broadcast rank 0's anyway)
    x_train, y_train, x_test, y_test = common.load_digits_split(args.seed)
    # Each rank takes every world_size-th sample: disjoint shards of the same split.
    x_train, y_train = x_train[rank::world_size].to(device), y_train[rank::world_size].to(device)

    model = build_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)

    losses = common.train_distributed(model, optimizer, x_train, y_train, args, rank, world_size)

    # Parameters, the fp32 master copies the optimizer updates, and buffers must all agree.
    tensors = list(model.parameters()) + list(amp.master_params(optimizer)) + list(model.buffers())
    identical = ranks_agree(tensors)
    if rank == 0:
        model.eval()
        with torch.no_grad():
            predictions = model.module(x_test.to(device)).argmax(dim=1).cpu()
        accuracy = 100.0 * (predictions == y_test).float().mean().item()
        fell = common.report_loss_trend(f"{args.opt_level} {backend} x{world_size}", losses)
        print(f"test accuracy {accuracy:.2f}%; parameters identical on all {world_size} ranks: "
              f"{identical}")
    else:
        fell = common.window_mean(losses, False) < common.window_mean(losses, True)
    return common.distributed_exit_status(identical, args.smoke, fell, rank)


if __name__ == "__main__":
    sys.exit(main())
