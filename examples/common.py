"""Data and command-line helpers shared by the examples.

Every example trains on scikit-learn's bundled 8x8 handwritten digits, so nothing is downloaded
and a CPU run takes seconds. The split, the shuffling and the model initialisation are all driven
by one seed, so two runs with the same arguments print the same numbers.
"""
import argparse
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import amp
from amp.frontend import OPT_LEVELS

TEST_FRACTION = 0.2
# load_digits() holds 1797 images; a 0.2 test split leaves these for training. Known up front so
# that argparse can reject a batch size no epoch could fill.
TRAIN_SIZE = 1437


def load_digits_split(seed, value_range=(0.0, 1.0)):
    """Return ``x_train, y_train, x_test, y_test`` as CPU tensors (``TRAIN_SIZE`` training images).

    Images are float32 of shape (N, 1, 8, 8) scaled to ``value_range`` (the raw pixels are 0..16);
    labels are int64. The split is stratified and fixed by ``seed``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    low, high = value_range
    images = digits.images.astype(np.float32) / 16.0 * (high - low) + low
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=TEST_FRACTION, random_state=seed, stratify=digits.target)

    def to_tensors(x, y):
        return torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y).long()

    return (*to_tensors(x_train, y_train), *to_tensors(x_test, y_test))


def batches(x, y, batch_size, generator):
    """Yield shuffled ``(x, y)`` mini-batches; the last, smaller batch is dropped so every step
    sees the same batch size."""
    order = torch.randperm(len(x), generator=generator)
    for start in range(0, len(x) - batch_size + 1, batch_size):
        index = order[start:start + batch_size]
        yield x[index], y[index]


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _bounded_int(text, low, high, expected):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < low or (high is not None and value >= high):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def positive_int(text):
    return _bounded_int(text, 1, None, "a positive integer")


def seed_arg(text):
    return _bounded_int(text, 0, 2**32, "a seed in [0, 2**32)")  # what numpy and scikit-learn accept


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text}")
    return value


def batch_size_arg(shards=1):
    """An argparse type for ``--batch-size``: positive, and no larger than one shard of the
    training set, so every epoch has at least one full batch."""
    limit = TRAIN_SIZE // shards

    def parse(text):
        value = positive_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(
                f"{value} is more than the {limit} training images" + (" per process" if shards > 1 else ""))
        return value

    return parse


def device_arg(text):
    """An argparse type: a torch device that exists on this machine."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            f"{text!r} was asked for but this PyTorch sees no CUDA GPU; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"device type {device.type!r} is not supported here; "
                                         "use 'cpu' or 'cuda'")
    return device


def default_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def add_common_args(parser, default_opt_level):
    """The options every example shares: precision preset, device, seed and smoke mode."""
    parser.add_argument("--opt-level", choices=list(OPT_LEVELS), default=default_opt_level,
                        help="amp preset: O0 fp32, O1 fp16 casts, O2 fp16 model with fp32 masters, "
                             "O3 pure fp16, O4/O5 the bfloat16 versions of O1/O2 "
                             f"(default {default_opt_level})")
    parser.add_argument("--device", type=device_arg, default=default_device(),
                        help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    parser.add_argument("--seed", type=seed_arg, default=0, help="seed for the split, init and order")
    parser.add_argument("--smoke", action="store_true",
                        help="a few steps only; exit with status 1 unless the loss fell")


def add_distributed_args(parser, lr):
    """The options of the torchrun examples: epochs, the per-process batch size, the learning rate."""
    parser.add_argument("--epochs", type=positive_int, default=10)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    parser.add_argument("--batch-size", type=batch_size_arg(shards=world_size), default=32,
                        help="per process")
    parser.add_argument("--lr", type=positive_float, default=lr)


def parse_under_torchrun(parser, argv, script):
    """``parser.parse_args(argv)``, refused with the command to run when torchrun did not start us."""
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error(f"launch me with torchrun, e.g. torchrun --nproc_per_node=2 {script}")
    return args


def distributed_exit_status(consistent, smoke, fell, rank):
    """1 when the ranks ended inconsistent, or a smoke run's loss did not fall (said by rank 0), else 0."""
    if not consistent:
        return 1
    if smoke and not fell:
        if rank == 0:
            print("smoke run failed: the training loss did not fall", file=sys.stderr)
        return 1
    return 0


def train_distributed(model, optimizer, x_train, y_train, args, rank, world_size):
    """This rank's training steps (``--epochs``, 20 with ``--smoke``); the mean loss of each step
    over the ranks. Every rank takes the same number of steps, which the collectives need."""
    steps_per_epoch = len(x_train) // args.batch_size
    total_steps = min(20, steps_per_epoch * args.epochs) if args.smoke else steps_per_epoch * args.epochs
    # Seeded per rank: different shuffles, but every rank takes the same number of steps.
    order = torch.Generator().manual_seed(args.seed + rank)
    losses = []
    while len(losses) < total_steps:
        for inputs, targets in batches(x_train, y_train, args.batch_size, order):
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()  # DDP / FSDP2 reduce the (scaled) gradients in here
            optimizer.step()

            mean_loss = loss.detach().float().clone()
            dist.all_reduce(mean_loss)
            losses.append(mean_loss.item() / world_size)
            if rank == 0 and (len(losses) % 50 == 0 or len(losses) == total_steps):
                scale = amp.loss_scale(optimizer=optimizer)
                print(f"[{len(losses)}/{total_steps}] mean loss {losses[-1]:.4f} loss scale {scale:g}")
            if len(losses) == total_steps:
                break
    return losses


def window_mean(values, first):
    """Mean of the first (or last) tenth of ``values``, at least one element: a less noisy
    "first loss" / "last loss" than single mini-batches."""
    width = max(1, len(values) // 10)
    chunk = values[:width] if first else values[-width:]
    return sum(chunk) / len(chunk)


def report_loss_trend(name, losses):
    """Print ``<name> first loss X last loss Y`` and return whether the loss fell."""
    first, last = window_mean(losses, first=True), window_mean(losses, first=False)
    print(f"{name} first loss {first:.4f} last loss {last:.4f}")
    return last < first
