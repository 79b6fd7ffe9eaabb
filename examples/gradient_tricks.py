"""The workflows of PyTorch's "Automatic Mixed Precision examples" page, written with amp.

    python examples/gradient_tricks.py                    # all five, O2
    python examples/gradient_tricks.py --only penalty --opt-level O1

Each workflow is one function that trains a small MLP on the 8x8 digits and returns its losses:

- clip_gradients:   clip the unscaled gradients, which live on ``amp.master_params(optimizer)``;
- gradient_penalty: a penalty on the gradient norm, computed from autograd.grad of the scaled loss;
- accumulate:       one optimizer step per several micro-batches;
- multiple_losses:  two models, two optimizers, two losses with their own loss scales;
- checkpoint_resume: save model, optimizer and amp state, restore them into fresh objects, and
                    check the resumed run continues exactly like the uninterrupted one.
"""
import argparse
import os
import sys
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp

import common  # examples/common.py: this script's own folder is on sys.path

TRICKS = ("clip", "penalty", "accumulate", "multi", "checkpoint")


def build(seed, device):
    """A fresh fp32 MLP and its optimizer, before amp.initialize."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def build_with_amp(args, seed=None, **amp_options):
    """``build`` followed by ``amp.initialize`` at the chosen opt level."""
    model, optimizer = build(args.seed if seed is None else seed, args.device)
    return amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0, **amp_options)


class Batches:
    """Mini-batch ``step`` is a pure function of (seed, step), so a resumed run sees exactly the
    batches the uninterrupted run saw."""

    def __init__(self, x, y, batch_size, seed, device):
        self.x, self.y = x.to(device), y.to(device)
        self.batch_size, self.seed = batch_size, seed

    def __call__(self, step):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        index = torch.randint(len(self.x), (self.batch_size,), generator=generator)
        return self.x[index], self.y[index]


def clip_gradients(args, batches, max_norm=1.0):
    model, optimizer = build_with_amp(args)
    losses = []
    for step in range(args.steps):
        inputs, targets = batches(step)
        loss = F.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        # Clip what the optimizer is about to use. Under O2/O5 that is the fp32 master copies:
        # the model's own fp16/bf16 .grad are still multiplied by the loss scale (amp unscales
        # into the masters only), so clipping model.parameters() would measure a norm ~scale
        # times too large and leave the masters untouched. Without master weights the two are
        # the same tensors, so master_params is the right call at every opt level.
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm)
        optimizer.step()
        losses.append(loss.item())
    return losses


def gradient_penalty(args, batches, weight=0.1):
    model, optimizer = build_with_amp(args)
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for step in range(args.steps):
        inputs, targets = batches(step)
        loss = F.cross_entropy(model(inputs), targets)
        # Differentiate the SCALED loss, as backward would, so small low-precision gradients do
        # not underflow; then unscale with the same number before using them. If they overflowed,
        # the penalty is inf/NaN, so are the gradients below, and amp skips this step.
        scale = amp.loss_scale(optimizer=optimizer)
        scaled_grads = torch.autograd.grad(loss.float() * scale, params, create_graph=True)
        inv_scale = 1.0 / scale
        squares = [(g * inv_scale).float().pow(2).sum() for g in scaled_grads]
        grad_norm = torch.stack(squares).sum().sqrt()
        optimizer.zero_grad()
        with amp.scale_loss(loss + weight * grad_norm, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def accumulate(args, batches, micro_batches=4):
    model, optimizer = build_with_amp(args)
    losses = []
    for step in range(args.steps):
        optimizer.zero_grad()
        for micro in range(micro_batches):
            inputs, targets = batches(step * micro_batches + micro)
            # Divide so the accumulated gradient is the mean over the full batch.
            loss = F.cross_entropy(model(inputs), targets) / micro_batches
            # Each block unscales its own contribution and adds it to the gradient accumulated so
            # far, so a loss-scale change between micro-batches is harmless; an overflow in any
            # of them skips the step. (delay_unscale=True on all but the last block saves the
            # per-block unscale, but is only correct while the scale cannot change in between.)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            losses.append(loss.item() * micro_batches)
        optimizer.step()
    return losses


def multiple_losses(args, batches):
    (model0, opt0), (model1, opt1) = build(args.seed, args.device), build(args.seed + 1, args.device)
    # One initialize call for everything; num_losses gives each loss id its own loss scaler.
    [model0, model1], [opt0, opt1] = amp.initialize(
        [model0, model1], [opt0, opt1], opt_level=args.opt_level, num_losses=2, verbosity=0)
    losses = []
    for step in range(args.steps):
        inputs, targets = batches(step)
        out0, out1 = model0(inputs), model1(inputs)
        ensemble_loss = F.cross_entropy(out0 + out1, targets)  # reaches both models
        auxiliary_loss = F.cross_entropy(out1, targets)        # reaches model1 only
        opt0.zero_grad()
        opt1.zero_grad()
        # Pass every optimizer whose parameters this backward reaches.
        with amp.scale_loss(ensemble_loss, [opt0, opt1], loss_id=0) as scaled_loss:
            scaled_loss.backward(retain_graph=True)  # out1's graph is used again below
        with amp.scale_loss(auxiliary_loss, opt1, loss_id=1) as scaled_loss:
            scaled_loss.backward()
        opt0.step()
        opt1.step()
        losses.append(ensemble_loss.item() + auxiliary_loss.item())
    return losses


def _train(model, optimizer, batches, steps):
    losses = []
    for step in steps:
        inputs, targets = batches(step)
        loss = F.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def checkpoint_resume(args, batches):
    # A short growth interval makes the dynamic loss scale move during the run, so restoring it
    # (and its growth counter) matters for the resumed run to match.
    half = args.steps // 2
    model, optimizer = build_with_amp(args, growth_interval=7)
    losses = _train(model, optimizer, batches, range(half))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "checkpoint.pt")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "amp": amp.state_dict()}, path)
        uninterrupted = _train(model, optimizer, batches, range(half, args.steps))
        final_params = [p.detach().clone() for p in amp.master_params(optimizer)]

        # A "new process": the old run is gone (while it lives, amp.state_dict() would cover both
        # runs); different initial weights, then initialize, THEN load all three.
        del model, optimizer
        resumed_model, resumed_optimizer = build_with_amp(args, seed=args.seed + 1, growth_interval=7)
        checkpoint = torch.load(path, weights_only=True)  # plain tensors and numbers only
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    resumed = _train(resumed_model, resumed_optimizer, batches, range(half, args.steps))
    resumed_params = list(amp.master_params(resumed_optimizer))

    identical = resumed == uninterrupted and all(
        torch.equal(a, b) for a, b in zip(final_params, resumed_params))
    print(f"checkpoint: resumed run matches the uninterrupted one exactly: {identical}")
    return losses + uninterrupted if identical else None


WORKFLOWS = {"clip": clip_gradients, "penalty": gradient_penalty, "accumulate": accumulate,
             "multi": multiple_losses, "checkpoint": checkpoint_resume}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, default_opt_level="O2")
    parser.add_argument("--steps", type=common.positive_int, default=150,
                        help="optimizer steps per workflow (--smoke: 30)")
    parser.add_argument("--batch-size", type=common.batch_size_arg(), default=32)
    parser.add_argument("--only", choices=TRICKS, action="append",
                        help="run just this workflow (repeatable; default: all)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps = 30
    if args.steps < 2:
        parser.error("argument --steps: checkpoint_resume needs at least 2 steps")
    return args


def main(argv=None):
    args = parse_args(argv)
    common.seed_everything(args.seed)
    x_train, y_train, _, _ = common.load_digits_split(args.seed)
    batches = Batches(x_train, y_train, args.batch_size, args.seed, args.device)
    failed = []
    for name in args.only or TRICKS:
        losses = WORKFLOWS[name](args, batches)
        if losses is None or not common.report_loss_trend(f"{name} ({args.opt_level})", losses):
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
