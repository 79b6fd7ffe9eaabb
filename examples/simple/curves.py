"""The simple example's training curves: what a run records per step, and its picture.

``train.py --plot curves.png`` fills a :class:`History` and passes it to :func:`save_plot`:

- top panel: the loss of every step (thin, light) and its exponential moving average, dashed
  lines where a new epoch begins, a red x on every skipped step;
- bottom panel: the loss scale after every step on a log axis, with the same red x marks.

The figure is drawn by matplotlib's Agg renderer, without pyplot, so no display is needed.
"""
import math
from dataclasses import dataclass, field

EMA_DECAY = 0.95  # about a 20-step window; the example's default epoch is 44 steps
SKIP_STYLE = dict(linestyle="none", marker="x", color="tab:red", markersize=8, markeredgewidth=2)


@dataclass
class History:
    """One training run, step by step; entry ``i`` of each list is the ``i``-th ``optimizer.step()``.

    ``losses``: the unscaled loss of each step. ``scales``: the loss scale after each step's
    update (a skipped step shows as a drop at that step). ``applied``: whether each step changed
    the weights (``amp.last_step_applied``). ``epoch_starts``: the index of the first step of the
    second, third, ... epoch.
    """
    losses: list
    scales: list
    applied: list
    epoch_starts: list = field(default_factory=list)

    def __post_init__(self):
        if not len(self.losses) == len(self.scales) == len(self.applied):
            raise ValueError(f"one entry per step expected: {len(self.losses)} losses, "
                             f"{len(self.scales)} scales, {len(self.applied)} applied flags")
        if any(not 0 < start < len(self.losses) for start in self.epoch_starts):
            raise ValueError(f"epoch starts {self.epoch_starts} outside steps 1..{len(self.losses) - 1}")

    def __len__(self):
        return len(self.losses)

    @property
    def skipped_steps(self):
        """Indices of the steps that were skipped."""
        return [step for step, applied in enumerate(self.applied) if not applied]


def exponential_moving_average(values, decay=EMA_DECAY):
    """The bias-corrected EMA of ``values`` (corrected as Adam corrects its moments, so the first
    points are not pulled towards 0). A non-finite value is passed over: the average holds."""
    averages, total, weight = [], 0.0, 0.0
    for value in values:
        if math.isfinite(value):
            total = decay * total + (1 - decay) * value
            weight = decay * weight + (1 - decay)
        averages.append(total / weight if weight else math.nan)
    return averages


def draw(history, title):
    """The two-panel :class:`matplotlib.figure.Figure` of ``history``; steps are numbered from 1."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig = Figure(figsize=(7, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_scale = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    steps = range(1, len(history) + 1)
    skipped = history.skipped_steps
    skipped_x = [step + 1 for step in skipped]

    ax_loss.plot(steps, history.losses, color="tab:blue", alpha=0.35, linewidth=0.8, label="loss")
    ax_loss.plot(steps, exponential_moving_average(history.losses), color="tab:blue", linewidth=2,
                 label=f"EMA of the loss (decay {EMA_DECAY})")
    ax_loss.plot(skipped_x, [history.losses[step] for step in skipped], **SKIP_STYLE,
                 label=f"skipped step ({len(skipped)})")
    # Masked, not clipped: a loss that rounds to 0 would otherwise draw a spike to the axis floor.
    ax_loss.set_yscale("log", nonpositive="mask")
    # Plain numbers (0.01, not 10^-2): a loss is read off, not its exponent. Labels at the powers of
    # ten, and at 2 and 5 times them too where the losses span less than a hundredfold (short runs).
    positive = [loss for loss in history.losses if 0 < loss < math.inf]
    if positive and max(positive) < 100 * min(positive):
        ax_loss.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax_loss.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax_loss.yaxis.set_minor_formatter(NullFormatter())
    ax_loss.set_ylabel("training loss")

    ax_scale.step(steps, history.scales, where="post", color="tab:green", linewidth=1.5)
    ax_scale.plot(skipped_x, [history.scales[step] for step in skipped], **SKIP_STYLE)
    ax_scale.set_yscale("log", base=2)
    ax_scale.margins(y=0.15)  # keeps a red x on the lowest scale clear of the axis
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_xlabel("step")
    ax_scale.set_xlim(0, len(history) + 1)

    for number, start in enumerate(history.epoch_starts):
        for ax in (ax_loss, ax_scale):
            ax.axvline(start + 0.5, color="0.6", linestyle="--", linewidth=0.8,
                       label="epoch boundary" if ax is ax_loss and number == 0 else None)
    ax_loss.legend(loc="upper right", fontsize="small")
    for ax in (ax_loss, ax_scale):
        ax.grid(True, which="major", alpha=0.3)
    fig.suptitle(title)
    return fig


def save_plot(history, path, title, dpi=100):
    """Draw ``history`` and write it to ``path`` (PNG, 700x480 pixels at the default ``dpi``)."""
    draw(history, title).savefig(path, dpi=dpi)
