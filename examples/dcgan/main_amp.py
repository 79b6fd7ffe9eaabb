"""A tiny DCGAN on the 8x8 digits: two models, two optimizers and three losses under amp.

    python examples/dcgan/main_amp.py --opt-level O1 --outf out/

What it shows:
- ``amp.initialize([netD, netG], [optimizerD, optimizerG], num_losses=3)`` returns lists in the
  same order;
- each loss has its own ``loss_id`` and therefore its own dynamic loss scale, so an overflow in
  the generator's loss does not shrink the discriminator's scale;
- the discriminator's gradients from the real and the fake batch are accumulated over two
  ``scale_loss`` blocks before one ``optimizerD.step()``; amp unscales each contribution with its
  own scale and adds them;
- ``BCEWithLogitsLoss`` instead of ``Sigmoid`` + ``BCELoss``: BCE on probabilities is unsafe in
  fp16 (O1 refuses it), the fused version is stable. Its targets must be floating point.
"""
import argparse
import os
import sys

import numpy as np
import torch
import torch.nn as nn

import amp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402  (examples/common.py, found through the line above)

REAL_LABEL, FAKE_LABEL = 1.0, 0.0


class Generator(nn.Module):
    """Noise (nz x 1 x 1) -> 4x4 -> 8x8 image in [-1, 1]."""

    def __init__(self, nz, ngf):
        super().__init__()
        self.net = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(),
            nn.Conv2d(ngf, 1, 3, 1, 1), nn.Tanh(),
        )

    def forward(self, z):
        return self.net(z)


class Discriminator(nn.Module):
    """8x8 image -> 4x4 -> 2x2 -> one logit per image (no sigmoid: see BCEWithLogitsLoss)."""

    def __init__(self, ndf):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2),
            nn.Conv2d(ndf * 2, 1, 2, 1, 0),
        )

    def forward(self, x):
        return self.net(x).flatten()


def weights_init(module):
    if isinstance(module, (nn.Conv2d, nn.ConvTranspose2d)):
        nn.init.normal_(module.weight, 0.0, 0.02)
    elif isinstance(module, nn.BatchNorm2d):
        nn.init.normal_(module.weight, 1.0, 0.02)
        nn.init.zeros_(module.bias)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, default_opt_level="O1")
    parser.add_argument("--epochs", type=common.positive_int, default=10)
    parser.add_argument("--batch-size", type=common.batch_size_arg(), default=64)
    parser.add_argument("--nz", type=common.positive_int, default=16, help="size of the latent vector")
    parser.add_argument("--ngf", type=common.positive_int, default=16, help="generator width")
    parser.add_argument("--ndf", type=common.positive_int, default=16, help="discriminator width")
    parser.add_argument("--lr", type=common.positive_float, default=5e-4)
    parser.add_argument("--beta1", type=float, default=0.5, help="Adam's beta1")
    parser.add_argument("--outf", default=".", help="folder for fake_samples.png")
    args = parser.parse_args(argv)
    if not 0.0 <= args.beta1 < 1.0:
        parser.error(f"argument --beta1: expected a value in [0, 1), got {args.beta1}")
    return args


def save_grid(path, images, upscale=4):
    """Tile (N, 1, 8, 8) images in [-1, 1] into a square grayscale PNG, nearest-neighbour upscaled."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt

    images = images.detach().float().cpu().squeeze(1).numpy()
    side = int(np.ceil(np.sqrt(len(images))))
    height, width = images.shape[1:]
    grid = np.full((side * (height + 1) + 1, side * (width + 1) + 1), -1.0, dtype=np.float32)
    for i, image in enumerate(images):
        row, col = divmod(i, side)
        top, left = 1 + row * (height + 1), 1 + col * (width + 1)
        grid[top:top + height, left:left + width] = image
    grid = grid.repeat(upscale, axis=0).repeat(upscale, axis=1)
    plt.imsave(path, grid, cmap="gray", vmin=-1.0, vmax=1.0)


def sample_gap(netG, noise, real_mean):
    """Mean absolute difference between the average generated image and the average real one.

    GAN losses hover around an equilibrium instead of falling, so this is the progress signal:
    it starts large (an untrained generator paints mid-grey) and shrinks as G learns the data.
    """
    netG.eval()
    with torch.no_grad():
        fake_mean = netG(noise).float().mean(dim=0)
    netG.train()
    return (fake_mean - real_mean).abs().mean().item()


def main(argv=None):
    args = parse_args(argv)
    common.seed_everything(args.seed)
    device = args.device
    # Tanh makes the generator's range [-1, 1]; scale the real images to match.
    x_train, _, _, _ = common.load_digits_split(args.seed, value_range=(-1.0, 1.0))
    x_train = x_train.to(device)

    netG = Generator(args.nz, args.ngf).to(device)
    netD = Discriminator(args.ndf).to(device)
    netG.apply(weights_init)
    netD.apply(weights_init)
    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))

    [netD, netG], [optimizerD, optimizerG] = amp.initialize(
        [netD, netG], [optimizerD, optimizerG], opt_level=args.opt_level, num_losses=3, verbosity=0)

    criterion = nn.BCEWithLogitsLoss()
    fixed_noise = torch.randn(64, args.nz, 1, 1, device=device)
    real_mean = x_train.mean(dim=0)
    gaps = [sample_gap(netG, fixed_noise, real_mean)]
    order = torch.Generator().manual_seed(args.seed)
    total_steps = 30 if args.smoke else args.epochs * (len(x_train) // args.batch_size)
    step = 0
    while step < total_steps:
        for real, _ in common.batches(x_train, x_train, args.batch_size, order):
            batch = real.size(0)
            # Float targets: BCEWithLogitsLoss rejects the int64 tensor torch.full(..., 1) gives.
            real_target = torch.full((batch,), REAL_LABEL, device=device)
            fake_target = torch.full((batch,), FAKE_LABEL, device=device)

            # (1) Discriminator: maximise log D(x) + log(1 - D(G(z))), one backward per term.
            optimizerD.zero_grad()
            errD_real = criterion(netD(real), real_target)
            with amp.scale_loss(errD_real, optimizerD, loss_id=0) as scaled_loss:
                scaled_loss.backward()
            fake = netG(torch.randn(batch, args.nz, 1, 1, device=device))
            errD_fake = criterion(netD(fake.detach()), fake_target)
            with amp.scale_loss(errD_fake, optimizerD, loss_id=1) as scaled_loss:
                scaled_loss.backward()
            optimizerD.step()  # uses the sum of both blocks' unscaled gradients

            # (2) Generator: maximise log D(G(z)). Its backward also reaches netD's grads; the
            # optimizerD.zero_grad() above clears those before they could be used.
            optimizerG.zero_grad()
            errG = criterion(netD(fake), real_target)
            with amp.scale_loss(errG, optimizerG, loss_id=2) as scaled_loss:
                scaled_loss.backward()
            optimizerG.step()

            step += 1
            if step % 50 == 0 or step == total_steps:
                gaps.append(sample_gap(netG, fixed_noise, real_mean))
                scales = "/".join(f"{amp.loss_scale(i, optimizerD):g}" for i in range(3))
                print(f"[{step}/{total_steps}] loss_D {(errD_real + errD_fake).item():.4f} "
                      f"loss_G {errG.item():.4f} "
                      f"sample gap {gaps[-1]:.4f} loss scales (D real/D fake/G) {scales}")
            if step == total_steps:
                break

    os.makedirs(args.outf, exist_ok=True)
    netG.eval()
    with torch.no_grad():
        samples = netG(fixed_noise)
    save_grid(os.path.join(args.outf, "fake_samples.png"), samples)
    save_grid(os.path.join(args.outf, "real_samples.png"), x_train[:64])
    print(f"wrote {os.path.join(args.outf, 'fake_samples.png')}")
    print(f"sample gap first {gaps[0]:.4f} last {gaps[-1]:.4f}")
    if args.smoke and not gaps[-1] < gaps[0]:
        print("smoke run failed: the generated images did not move towards the data",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
