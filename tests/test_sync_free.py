"""Sync-free loss scaling: fused optimizers get the overflow flag on the device, never on the host."""
import contextlib

import pytest
import torch
from torch import nn

import amp
from amp_common import has_fused, needs_fused

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def count_host_reads():
    """Count every way a tensor's value can reach Python (on a GPU each one is a sync)."""
    calls = []
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name):
        def read(self, *args, **kwargs):
            calls.append(name)
            return originals[name](self, *args, **kwargs)
        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def make_model(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).to(device)


def train_step(model, optimizer, x, y, inject_inf=False):
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x).float(), y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
        if inject_inf:
            next(model.parameters()).grad[0].fill_(float("inf"))
    optimizer.step()


def snapshot(model, optimizer):
    params = [p.detach().clone() for p in amp.master_params(optimizer)]
    params += [p.detach().clone() for p in model.parameters()]
    state = [t.clone() for s in optimizer.state.values() for t in s.values()]
    return params + state


def assert_all_equal(before, after):
    assert len(before) == len(after)
    for a, b in zip(before, after):
        assert torch.equal(a, b)


def data(device="cpu"):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=generator).to(device)
    y = torch.randint(0, 4, (32,), generator=generator).to(device)
    return x, y


def test_fused_tests_skip_only_where_torch_has_no_fused_cpu_optimizers():
    # Guards needs_fused: a probe that failed for another reason would silently skip the tests.
    classes = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
    expected = torch.torch_version.TorchVersion(torch.__version__) >= (2, 4)
    assert [has_fused(cls) for cls in classes] == [expected] * len(classes)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("optimizer_class", [
    pytest.param(cls, marks=needs_fused(cls), id=cls.__name__)
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)])
def test_fused_optimizer_step_reads_nothing_on_the_host(opt_level, optimizer_class):
    model = make_model()
    optimizer = optimizer_class(model.parameters(), lr=1e-2, fused=True)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    x, y = data()
    train_step(model, optimizer, x, y)  # the first step builds optimizer state
    with count_host_reads() as reads:
        for step in range(4):
            train_step(model, optimizer, x, y, inject_inf=(step == 2))
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        assert reads == []
    else:
        # torch 2.5's fused Adagrad lacks the found_inf contract: amp reads the flag once a step
        # (and, with it already on the host, the scale for the skip message).
        assert reads == ["tolist", "tolist", "tolist", "item", "tolist"]
    assert amp.skipped_steps(optimizer).item() == 1


def test_unfused_optimizer_reads_the_flag_once_per_step():
    model = make_model()
    # SGD, because Adam's own step reads its (host-side) step counters with .item().
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    x, y = data()
    train_step(model, optimizer, x, y)
    with count_host_reads() as reads:
        for _ in range(3):
            train_step(model, optimizer, x, y)
    assert reads == ["tolist"] * 3


@needs_fused(torch.optim.Adam)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fused_skip_leaves_params_state_and_step_counters_untouched(opt_level):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    x, y = data()
    train_step(model, optimizer, x, y)
    scale_before = amp._amp_state.loss_scalers[0].loss_scale()
    before = snapshot(model, optimizer)
    train_step(model, optimizer, x, y, inject_inf=True)
    assert_all_equal(before, snapshot(model, optimizer))
    assert amp._amp_state.loss_scalers[0].loss_scale() == scale_before / 2
    assert not amp.last_step_applied(optimizer).item()
    if opt_level == "O2":
        assert all(m.grad is None for m in optimizer._amp_stash.all_fp32_from_fp16_params)


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=needs_fused(torch.optim.Adam))])
def test_fused_and_unfused_adam_train_to_the_same_values(fused):
    """The sync-free path changes where the skip decision is made, not the arithmetic."""
    def run(fused):
        model = make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
        x, y = data()
        for step in range(6):
            train_step(model, optimizer, x, y, inject_inf=step in (1, 4))
        return [p.detach().clone() for p in amp.master_params(optimizer)], amp.skipped_steps(optimizer)

    reference, reference_skips = run(fused=False)
    masters, skips = run(fused)
    assert skips.item() == reference_skips.item() == 2
    for a, b in zip(reference, masters):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=needs_fused(torch.optim.SGD))])
def test_last_step_applied_and_skipped_steps_follow_skips(fused):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    x, y = data()
    applied = []
    for step in range(5):
        train_step(model, optimizer, x, y, inject_inf=step in (0, 3))
        applied.append(bool(amp.last_step_applied(optimizer)))
    assert applied == [False, True, True, False, True]
    assert amp.skipped_steps(optimizer).item() == 2
    assert amp.skipped_steps(optimizer).device == next(model.parameters()).device


@needs_fused(torch.optim.Adam)
def test_ema_that_follows_skips_without_a_sync():
    """The documented pattern: scale the EMA update by last_step_applied on the device."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    masters = list(amp.master_params(optimizer))
    ema = [m.detach().clone() for m in masters]
    x, y = data()
    for step in range(4):
        ema_before = [e.clone() for e in ema]
        train_step(model, optimizer, x, y, inject_inf=(step == 2))
        weight = 0.1 * amp.last_step_applied(optimizer).float()
        torch._foreach_lerp_(ema, [m.detach() for m in masters], weight)
        if step == 2:
            assert_all_equal(ema_before, ema)


@needs_fused(torch.optim.Adam)
def test_consecutive_skip_limit_also_trips_on_the_sync_free_path():
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0,
                                      max_consecutive_skips=3)
    x, y = data()
    with pytest.raises(amp.NonFiniteGradientsError, match=r"0\.weight"):
        for _ in range(10):
            train_step(model, optimizer, x, y, inject_inf=True)
    # On CPU the host reads the device counts themselves, so the error comes at the first skip
    # past the limit (on CUDA the host copy lags a step: it would come at the 5th).
    assert amp.skipped_steps(optimizer).item() == 4


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O5"])
def test_compiled_model_trains_like_the_eager_one(opt_level):
    """torch.compile wraps the forward; amp's backward and step run around it unchanged."""
    def run(compile_model):
        torch._dynamo.reset()
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
        torch.manual_seed(0)
        for p in model.parameters():
            nn.init.normal_(p, std=0.3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
        forward = torch.compile(model, backend="aot_eager") if compile_model else model
        x, y = data()
        losses = []
        for _ in range(4):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(forward(x).float(), y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in amp.master_params(optimizer)]

    eager_losses, eager_params = run(compile_model=False)
    losses, params = run(compile_model=True)
    assert losses[-1] < losses[0]
    torch.testing.assert_close(losses, eager_losses, rtol=2e-2, atol=1e-3)
    for a, b in zip(params, eager_params):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O4", "O5"])
def test_compiled_forward_is_one_graph(opt_level):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    explanation = torch._dynamo.explain(model)(data()[0])
    assert explanation.graph_break_count == 0


@pytest.mark.cuda
@pytest.mark.parametrize("opt_level", ["O1", "O2", "O5"])
def test_cuda_fused_step_has_no_sync(opt_level):
    model = make_model("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    x, y = data("cuda")
    train_step(model, optimizer, x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(4):
            train_step(model, optimizer, x, y, inject_inf=(step == 2 and opt_level != "O5"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = 0 if opt_level == "O5" else 1
    assert amp.skipped_steps(optimizer).item() == expected


@needs_fused(torch.optim.SGD)
@pytest.mark.filterwarnings("ignore:amp. the dynamic loss scale fell")
def test_scale_floor_limit_also_trips_on_the_sync_free_path_without_host_reads():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, fused=True)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0,
                                      backoff_factor=2.0**-8, max_steps_at_scale_floor=3)
    x, y = data()
    steps = []
    with count_host_reads() as reads, pytest.raises(amp.LossScaleFloorError, match="for 4 step"):
        for step in range(40):
            train_step(model, optimizer, x, y, inject_inf=step % 4 == 0)  # never twice in a row
            steps.append(step)
    assert reads == []
    # The fifth overflow (step 16) reaches the floor 2**-24; three more steps are allowed there.
    assert steps[-1] == 18
