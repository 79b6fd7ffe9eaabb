"""Train a small CNN on scikit-learn's 8x8 digits with amp, on CPU or GPU.

    python examples/simple/train.py                      # O2 on cuda if present, else cpu
    python examples/simple/train.py --opt-level O0       # the fp32 baseline to compare with
    python examples/simple/train.py --opt-level O1 --plot curves.png

The amp-specific lines are the three marked "amp:"; everything else is an ordinary training loop.
``--plot`` draws the loss, the loss scale and the skipped steps against the step (``curves.py``).
"""
import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import amp  # amp: where Apex code had `from apex import amp`

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402  (examples/common.py, found through the line above)
import curves  # noqa: E402  (examples/simple/curves.py, next to this script)


class DigitsNet(nn.Module):
    """One conv block and an MLP head. The BatchNorm layer is what O2/O5 keep in fp32.

    Deliberately a single, narrow conv: PyTorch's CPU fp16 convolutions are a slow fallback
    on most CPUs (a 32->64 channel 3x3 conv is ~15x slower in fp16 than in fp32), and this
    example should run O1/O2 on a laptop in seconds. On a GPU any width is fine.
    """

    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, default_opt_level="O2")
    parser.add_argument("--epochs", type=common.positive_int, default=8)
    parser.add_argument("--batch-size", type=common.batch_size_arg(), default=32)
    parser.add_argument("--lr", type=common.positive_float, default=0.05)
    parser.add_argument("--plot", metavar="PNG",
                        help="save the loss, the loss scale and the skipped steps per step to this PNG")
    return parser.parse_args(argv)


def evaluate(model, x, y, batch_size=512):
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            logits = model(x[start:start + batch_size])
            correct += (logits.argmax(dim=1) == y[start:start + batch_size]).sum().item()
    model.train()
    return 100.0 * correct / len(x)


def main(argv=None):
    args = parse_args(argv)
    common.seed_everything(args.seed)
    device = args.device
    x_train, y_train, x_test, y_test = (t.to(device) for t in common.load_digits_split(args.seed))

    model = DigitsNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # amp: after the model is on its device and the optimizer is built, before DDP or any wrapper.
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)
    scaler = amp.loss_scaler(optimizer=optimizer)

    steps_per_epoch = len(x_train) // args.batch_size
    total_steps = min(25, steps_per_epoch * args.epochs) if args.smoke else steps_per_epoch * args.epochs
    order = torch.Generator().manual_seed(args.seed)
    losses, scales, epoch_starts = [], [], []
    # Only for the plot: whether each step was applied, kept as device tensors and read once at
    # the end, so plotting adds no per-step sync.
    applied = [] if args.plot else None
    progress = tqdm(total=total_steps, desc=f"{args.opt_level} {device}", disable=args.smoke,
                    dynamic_ncols=True)
    start = time.perf_counter()
    while len(losses) < total_steps:
        if losses:
            epoch_starts.append(len(losses))
        for inputs, targets in common.batches(x_train, y_train, args.batch_size, order):
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            # amp: backward through the scaled loss; amp unscales the grads (or skips the step).
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()

            losses.append(loss.item())
            scales.append(scaler.loss_scale())
            if applied is not None:
                applied.append(amp.last_step_applied(optimizer))
            progress.set_postfix(loss=f"{losses[-1]:.4f}", scale=f"{scales[-1]:g}", refresh=False)
            progress.update()
            if len(losses) == total_steps:
                break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds_per_step = (time.perf_counter() - start) / total_steps
    progress.close()

    accuracy = evaluate(model, x_test, y_test)
    if args.plot:
        history = curves.History(losses, scales, torch.stack(applied).tolist(), epoch_starts)
        curves.save_plot(history, args.plot,
                         f"digits CNN, amp {args.opt_level} on {device}: test accuracy {accuracy:.2f}%")
        epochs = len(epoch_starts) + 1  # the last one may be partial
        print(f"plotted {len(history)} steps ({len(history.skipped_steps)} skipped) over {epochs} "
              f"epoch{'s' if epochs > 1 else ''} to {args.plot}")
    fell = common.report_loss_trend(args.opt_level, losses)
    print(f"{args.opt_level} on {device}: test accuracy {accuracy:.2f}%, "
          f"{int(amp.skipped_steps(optimizer))} of {total_steps} steps skipped, "
          f"final loss scale {scales[-1]:g}, {1000 * seconds_per_step:.2f} ms/step")
    if args.smoke and not fell:
        print("smoke run failed: the training loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
