"""An Apex-era distributed script, unmodified: apex.amp, apex.parallel DDP, SyncBatchNorm and LARC.

    python -m amp.apex enable                                         # once per environment
    torchrun --nproc_per_node=2 examples/apex_style/train_apex.py      # gloo on CPU

Every import below is Apex's; the drop-in switch makes them resolve to amp (without the switch
they fail, as they do since Apex removed amp). The recipe is Apex's imagenet example's:
``convert_syncbn_model``, then ``amp.initialize``, then ``apex.parallel.DistributedDataParallel``
with ``delay_allreduce=True``, an SGD optimizer wrapped in ``LARC``. At the end every rank checks
that parameters, fp32 masters and BatchNorm statistics are bitwise the same on all ranks.
"""
import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

try:
    from apex import amp
    from apex.parallel import convert_syncbn_model
    from apex.parallel.LARC import LARC
    from apex.parallel import DistributedDataParallel as DDP
except ImportError as error:
    sys.exit(f"train_apex.py: {error}. Run `python -m amp.apex enable` first.")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402  (examples/common.py, found through the line above)
from distributed.train_ddp import ranks_agree  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, default_opt_level="O2")
    common.add_distributed_args(parser, lr=0.1)
    parser.add_argument("--trust-coefficient", type=common.positive_float, default=0.02)
    return common.parse_under_torchrun(parser, argv, "examples/apex_style/train_apex.py")


def build_model():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(),
                         nn.Linear(128, 10))


def train(args, rank, world_size, device):
    common.seed_everything(args.seed + rank)  # seeded apart: DDP broadcasts rank 0's weights
    x_train, y_train, x_test, y_test = common.load_digits_split(args.seed)
    x_train, y_train = x_train[rank::world_size].to(device), y_train[rank::world_size].to(device)

    model = convert_syncbn_model(build_model()).to(device)
    optimizer = LARC(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4),
                     trust_coefficient=args.trust_coefficient)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)
    model = DDP(model, delay_allreduce=True)

    steps_per_epoch = len(x_train) // args.batch_size
    total_steps = min(20, steps_per_epoch * args.epochs) if args.smoke else steps_per_epoch * args.epochs
    order = torch.Generator().manual_seed(args.seed + rank)
    losses = []
    while len(losses) < total_steps:
        for inputs, targets in common.batches(x_train, y_train, args.batch_size, order):
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            mean_loss = loss.detach().float().clone()
            dist.all_reduce(mean_loss)
            losses.append(mean_loss.item() / world_size)
            if len(losses) == total_steps:
                break

    tensors = list(model.parameters()) + list(amp.master_params(optimizer)) + list(model.buffers())
    identical = ranks_agree(tensors)
    fell = common.window_mean(losses, False) < common.window_mean(losses, True)
    if rank == 0:
        model.eval()
        with torch.no_grad():
            predictions = model.module(x_test.to(device)).argmax(dim=1).cpu()
        accuracy = 100.0 * (predictions == y_test).float().mean().item()
        common.report_loss_trend(f"{args.opt_level} x{world_size}", losses)
        print("losses " + " ".join(f"{value:.4f}" for value in losses[::max(1, len(losses) // 10)]))
        print(f"test accuracy {accuracy:.2f}%; parameters identical on all {world_size} ranks: "
              f"{identical}")
    return common.distributed_exit_status(identical, args.smoke, fell, rank)


def main(argv=None):
    args = parse_args(argv)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    code = train(args, rank, world_size, device)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
