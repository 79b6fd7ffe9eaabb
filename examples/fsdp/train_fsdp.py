"""FSDP2 (fully_shard) with amp: each process holds half of the fp32 weights and optimizer state.

    torchrun --nproc_per_node=2 examples/fsdp/train_fsdp.py              # gloo on CPU, O2
    torchrun --nproc_per_node=2 examples/fsdp/train_fsdp.py --opt-level O5

The order is the opposite of DDP's: fully_shard the model first (each layer, then the root),
build the optimizer on the sharded parameters, then amp.initialize. At O2/O5 amp sets FSDP2's
MixedPrecisionPolicy, so the layers compute in fp16/bf16 on all-gathered copies while the
sharded fp32 parameters are the master weights; loss scaling and skipped steps are amp's, agreed
by every rank. The script checks at the end that each rank holds only its shard.
"""
import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import amp

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6 keeps it here (torch 2.3's runs on CUDA only)
    try:
        from torch.distributed._composable.fsdp import fully_shard
    except ImportError:
        fully_shard = None

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402  (examples/common.py, found through the line above)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, default_opt_level="O2")
    common.add_distributed_args(parser, lr=0.05)
    args = common.parse_under_torchrun(parser, argv, "examples/fsdp/train_fsdp.py")
    if fully_shard is None:
        parser.error(f"torch {torch.__version__} has no FSDP2 (fully_shard); upgrade torch")
    return args


def build_model():
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def main(argv=None):
    args = parse_args(argv)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend)
    code = train(args, rank, world_size, device, backend)
    gc.collect()
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
    return code


def train(args, rank, world_size, device, backend):
    """Train this rank's data shard; 0 when each rank held half the weights (and the loss fell)."""
    common.seed_everything(args.seed)
    x_train, y_train, x_test, y_test = common.load_digits_split(args.seed)
    x_train, y_train = x_train[rank::world_size].to(device), y_train[rank::world_size].to(device)

    model = build_model().to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)  # the root last
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)  # after fully_shard
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)

    losses = common.train_distributed(model, optimizer, x_train, y_train, args, rank, world_size)

    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    sharded = local <= -(-total // world_size) + len(list(model.parameters()))  # padding aside
    model.eval()
    with torch.no_grad():
        predictions = model(x_test.to(device)).argmax(dim=1).cpu()  # every rank joins the all-gathers
    if rank == 0:
        accuracy = 100.0 * (predictions == y_test).float().mean().item()
        fell = common.report_loss_trend(f"{args.opt_level} {backend} x{world_size} fsdp2", losses)
        print(f"test accuracy {accuracy:.2f}%; rank 0 holds {local} of {total} fp32 weights")
    else:
        fell = common.window_mean(losses, False) < common.window_mean(losses, True)
    return common.distributed_exit_status(sharded, args.smoke, fell, rank)


if __name__ == "__main__":
    sys.exit(main())
