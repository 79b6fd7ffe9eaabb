"""``master_weights="remainder"``: bf16 weights plus remainders train bit for bit as fp32 masters.

Each run below is made twice, with ``master_weights=True`` and ``"remainder"``, from the same
seeds and data, and every loss, model weight, master, optimizer state and checkpoint is compared
bit for bit. The kernels' own tests (every size across chunk boundaries, every dtype, halfway
cases) are in test_remainder_kernels.py; the encoding's are at the end here.
"""
import io

import pytest
import torch
from torch import nn

import amp
from amp._pytorch_ops import remainder
from amp._remainder_master import RemainderMaster

REMAINDER = "remainder"


def model_across_chunks(seed=0):
    """A model whose params straddle amp's chunk of 65536 elements (one 65792, one 65535), with
    batch norm (fp32, its own master) and a bias of odd size."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 257), nn.ReLU(), nn.BatchNorm1d(257), nn.Linear(257, 255, bias=False),
                         nn.Tanh(), nn.Linear(255, 3))


OPTIMIZERS = {
    "FusedAdam": lambda params: amp.optimizers.FusedAdam(params, lr=1e-3, weight_decay=0.01),
    "FusedAdam(materialize_master_grads=False)": lambda params: amp.optimizers.FusedAdam(
        params, lr=1e-3, weight_decay=0.01, materialize_master_grads=False),
    "FusedSGD": lambda params: amp.optimizers.FusedSGD(params, lr=1e-2, momentum=0.9, nesterov=True),
    "FusedLAMB": lambda params: amp.optimizers.FusedLAMB(params, lr=1e-3),
    "torch AdamW": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "torch SGD": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=False),
}


def initialized(master_weights, make_optimizer=OPTIMIZERS["FusedAdam"], seed=0):
    model = model_across_chunks(seed)
    return amp.initialize(model, make_optimizer(model.parameters()), opt_level="O5",
                          master_weights=master_weights, loss_scale="dynamic", verbosity=0)


def train(model, optimizer, steps, first=0, accumulate=2, overflow_every=7, clip=True):
    """Steps with two backward passes each, an inf loss now and then (a skipped step), clipping."""
    losses = []
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(step)
        for micro in range(accumulate):
            x = torch.randn(8, 256, generator=generator)
            loss = model(x.bfloat16()).float().pow(2).mean()
            if step % overflow_every == 3 and micro == 0:
                loss = loss * float("inf")
            with amp.scale_loss(loss, optimizer, delay_unscale=micro < accumulate - 1) as scaled_loss:
                scaled_loss.backward()
            losses.append(loss.item())
        if clip:
            torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def masters_of(optimizer):
    """Every master's fp32 value, a plain tensor (a remainder master is rebuilt)."""
    return [master.detach().clone() for master in amp.master_params(optimizer)]


def bits(t):
    """The bits of a float tensor (NaN payloads included), or an integer tensor as it is."""
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t


def assert_same_bits(first, second):
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(bits(a), bits(b))


def assert_same_state(first, second):
    assert first["param_groups"] == second["param_groups"]
    assert first["state"].keys() == second["state"].keys()
    for index, state in first["state"].items():
        assert state.keys() == second["state"][index].keys()
        for name, value in state.items():
            other = second["state"][index][name]
            if isinstance(value, torch.Tensor):
                assert torch.equal(bits(value), bits(other)), (index, name)
            else:
                assert value == other, (index, name)


def snapshot(model, optimizer, losses):
    return dict(losses=losses, weights=[p.detach().clone() for p in model.parameters()],
                masters=masters_of(optimizer), state=optimizer.state_dict(), model_state=model.state_dict())


def assert_same_run(a, b):
    assert a["losses"] == b["losses"] or all(x == y or (x != x and y != y) for x, y in zip(a["losses"], b["losses"]))
    assert_same_bits(a["weights"], b["weights"])
    assert_same_bits(a["masters"], b["masters"])
    assert_same_state(a["state"], b["state"])
    assert a["model_state"].keys() == b["model_state"].keys()
    assert_same_bits(list(a["model_state"].values()), list(b["model_state"].values()))


def test_the_60_step_fused_adam_run_with_overflows_and_accumulation_is_bit_identical_and_holds_less():
    runs = {}
    for master_weights in (True, REMAINDER):
        model, optimizer = initialized(master_weights)
        losses = train(model, optimizer, 60)
        runs[master_weights] = snapshot(model, optimizer, losses)
        if master_weights == REMAINDER:
            low = [m for m in amp.master_params(optimizer) if isinstance(m, RemainderMaster)]
            held = sum(m.remainders.nbytes for m in low) / sum(m.numel() for m in low)
    assert_same_run(runs[True], runs[REMAINDER])
    assert sum(not (x < float("inf")) for x in runs[True]["losses"]) == 9  # the injected overflows
    assert runs[True]["losses"][-1] < runs[True]["losses"][0]  # it trained
    assert 2.125 <= held < 2.13  # 2 B low half + 1 bit carry (+ padding) instead of a 4 B master


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_trains_bit_identically_with_remainders(name):
    runs = []
    for master_weights in (True, REMAINDER):
        model, optimizer = initialized(master_weights, OPTIMIZERS[name])
        runs.append(snapshot(model, optimizer, train(model, optimizer, 12)))
    assert_same_run(*runs)


def test_two_hundred_steps_with_a_resume_in_between_stay_bit_identical():
    """Hundreds of steps with overflows and accumulation; the remainder run is checkpointed at
    step 100 (model, optimizer, amp) and resumed in a new run built from another seed."""
    model, optimizer = initialized(True)
    reference = snapshot(model, optimizer, train(model, optimizer, 200, overflow_every=25))
    model, optimizer = initialized(REMAINDER)
    losses = train(model, optimizer, 100, overflow_every=25)
    buffer = io.BytesIO()
    torch.save(dict(model=model.state_dict(), optimizer=optimizer.state_dict(), amp=amp.state_dict()), buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    model, optimizer = initialized(REMAINDER, seed=1)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    losses += train(model, optimizer, 100, first=100, overflow_every=25)
    assert_same_run(reference, snapshot(model, optimizer, losses))


def test_a_checkpoint_holds_fp32_masters_and_loads_with_or_without_remainders_and_into_fp32():
    saved = {}
    for master_weights in (True, REMAINDER):
        model, optimizer = initialized(master_weights)
        train(model, optimizer, 5)
        saved[master_weights] = (model.state_dict(), optimizer.state_dict(), masters_of(optimizer))
    assert_same_bits(list(saved[True][0].values()), list(saved[REMAINDER][0].values()))
    assert all(v.dtype == torch.float32 for k, v in saved[REMAINDER][0].items() if "running" not in k and "num_batches" not in k)
    for source, target in ((True, REMAINDER), (REMAINDER, True)):
        model, optimizer = initialized(target, seed=3)
        model.load_state_dict(saved[source][0])
        optimizer.load_state_dict(saved[source][1])
        assert_same_bits(masters_of(optimizer), saved[source][2])
    plain = model_across_chunks(seed=4)
    plain.load_state_dict(saved[REMAINDER][0])
    assert_same_bits([p.detach() for p in plain.parameters()], saved[True][2])


def test_a_skipped_step_leaves_weights_remainders_and_state_untouched():
    model, optimizer = initialized(REMAINDER)
    train(model, optimizer, 2, overflow_every=1000)
    before = ([p.detach().clone() for p in model.parameters()],
              [m.remainders.clone() for m in amp.master_params(optimizer) if isinstance(m, RemainderMaster)],
              optimizer.state_dict())
    loss = model(torch.randn(8, 256).bfloat16()).float().sum() * float("inf")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    assert not amp.last_step_applied(optimizer)
    assert_same_bits(before[0], [p.detach() for p in model.parameters()])
    assert_same_bits(before[1], [m.remainders for m in amp.master_params(optimizer) if isinstance(m, RemainderMaster)])
    assert_same_state(before[2], optimizer.state_dict())


@pytest.mark.parametrize("name", ["FusedAdam", "torch AdamW"])
def test_a_param_written_in_place_between_steps_is_taken_into_its_master(name):
    """As with fp32 masters: a value written into the model between steps is what the next step steps."""
    runs = []
    for master_weights in (True, REMAINDER):
        model, optimizer = initialized(master_weights, OPTIMIZERS[name])
        train(model, optimizer, 2)
        with torch.no_grad():
            model[0].weight.mul_(0.5)  # an in-place edit of the bf16 param
        losses = train(model, optimizer, 3, first=2)
        runs.append(snapshot(model, optimizer, losses))
    assert_same_run(*runs)


@pytest.mark.parametrize("name", ["FusedAdam", "torch AdamW"])
def test_a_model_param_written_outside_amp_becomes_its_master(name):
    """Even a write that leaves every value as it was (a clamp within range): the remainders cannot
    tell it from a new value, so the param's value is the master from then on (an fp32 master
    would keep its low bits here: the one difference from fp32 masters, documented)."""
    model, optimizer = initialized(REMAINDER, OPTIMIZERS[name])
    train(model, optimizer, 2)
    with torch.no_grad():
        model[0].weight.clamp_(-1e4, 1e4)
    optimizer._amp_stash.weights.masters.refresh_written_elsewhere()
    masters = masters_of(optimizer)
    assert torch.equal(masters[0], model[0].weight.detach().float())
    assert not torch.equal(masters[2], model[3].weight.detach().float())  # an untouched param keeps its bits


def test_masters_read_as_fp32_tensors_and_a_view_that_could_lose_a_write_raises():
    model, optimizer = initialized(REMAINDER)
    train(model, optimizer, 2)
    master = next(m for m in amp.master_params(optimizer) if isinstance(m, RemainderMaster))
    value = master.detach().clone()
    assert value.dtype == torch.float32 and type(value) is torch.Tensor
    assert torch.equal(value.to(torch.bfloat16), model[0].weight.detach())
    assert float(master.detach().abs().sum()) == float(value.abs().sum())
    assert "RemainderMaster(" in repr(master)
    with pytest.raises(RuntimeError, match="master.clone"):
        master.view(-1)
    with pytest.raises(RuntimeError, match="master.clone"):
        master.detach()[0]
    ema = torch.zeros_like(value)
    ema.add_(master.detach(), alpha=0.5)  # a plain tensor written from a master: no view of it
    assert torch.equal(ema, value * 0.5)
    with torch.no_grad():
        master.mul_(2.0)  # an in-place write of the master reaches weight and remainders
    assert torch.equal(bits(master.detach().clone()), bits(value * 2.0))
    assert torch.equal(model[0].weight.detach(), (value * 2.0).to(torch.bfloat16))


def test_a_model_converted_after_initialize_is_refused_at_the_next_step_not_trained_on_garbage():
    model, optimizer = initialized(REMAINDER, OPTIMIZERS["torch AdamW"])
    train(model, optimizer, 1)
    with amp.scale_loss(model(torch.randn(8, 256).bfloat16()).float().sum(), optimizer) as scaled_loss:
        scaled_loss.backward()
    model.half()
    with pytest.raises(RuntimeError, match="model.half"):
        optimizer.step()


@pytest.mark.parametrize("options, message", [
    (dict(opt_level="O2"), "torch.bfloat16"),
    (dict(opt_level="O5", cast_model_type=torch.float16), "torch.bfloat16"),
    (dict(opt_level="O4"), "master_weights with O4"),  # Apex's refusal of masters at O1/O4
    (dict(opt_level="O5", master_weights="fp32"), "'remainder'"),
])
def test_remainders_are_refused_where_the_model_is_not_bf16_and_nothing_changes(options, message):
    model = model_across_chunks()
    optimizer = OPTIMIZERS["FusedAdam"](model.parameters())
    params = [p.detach().clone() for p in model.parameters()]
    options.setdefault("master_weights", REMAINDER)
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
        amp.initialize(model, optimizer, verbosity=0, **options)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert_same_bits(params, [p.detach() for p in model.parameters()])
    assert not hasattr(optimizer, "_amp_stash")


# ---- the encoding ----------------------------------------------------------------------------------


def adversarial_masters(n, seed=0):
    """fp32 bit patterns whose low halves are the halfway cases and their neighbours, both parities
    of the top half, zeros, subnormals, infinities, the largest finite values; then random ones."""
    generator = torch.Generator().manual_seed(seed)
    top = torch.randint(0, 2**16, (n,), generator=generator, dtype=torch.int64)
    low = torch.randint(0, 2**16, (n,), generator=generator, dtype=torch.int64)
    low[0::4] = 0x8000
    low[1::8] = 0x7FFF
    low[2::8] = 0x8001
    pattern = (top << 16) | low
    special = torch.tensor([0, 0x80000000, 0x00008000, 0x00018000, 0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000,
                            0x7F800000, 0xFF800000, 0x3F808000, 0x3F818000, 0xBF808000], dtype=torch.int64)
    pattern[:min(n, len(special))] = special[:n]
    pattern = torch.where(pattern >= 2**31, pattern - 2**32, pattern).to(torch.int32)
    masters = pattern.view(torch.float32)
    return torch.where(torch.isnan(masters), torch.zeros_like(masters), masters)


@pytest.mark.parametrize("n", [0, 1, 2, 31, 32, 33, 63, 64, 65, 1000, 65535, 65537])
def test_split_then_rebuild_gives_every_master_back_and_the_weight_is_torchs_rounding(n):
    masters = adversarial_masters(n)
    weights = torch.empty(n, dtype=torch.bfloat16)
    packed = torch.full((remainder.packed_numel(n),), -1, dtype=torch.int16)
    remainder.split(masters, weights, packed)
    assert torch.equal(bits(weights), bits(masters.to(torch.bfloat16)))
    assert torch.equal(bits(remainder.rebuild(weights, packed)), bits(masters))


def test_a_sixteen_bit_remainder_alone_could_not_tell_the_halfway_cases_apart():
    """Why the carry bit exists: two masters with the same weight and the same low half."""
    below = torch.tensor([0x3F818000], dtype=torch.int32).view(torch.float32)  # rounds up to 0x3F82
    above = torch.tensor([0x3F828000], dtype=torch.int32).view(torch.float32)  # rounds down to 0x3F82
    assert torch.equal(bits(below.to(torch.bfloat16)), bits(above.to(torch.bfloat16)))
    packed = [torch.empty(remainder.packed_numel(1), dtype=torch.int16) for _ in range(2)]
    for master, out in zip((below, above), packed):
        remainder.split(master, torch.empty(1, dtype=torch.bfloat16), out)
    assert packed[0][0] == packed[1][0]  # the same low half
    assert not torch.equal(packed[0], packed[1])  # told apart by the carry bit


def test_a_nan_master_comes_back_as_nan():
    masters = torch.tensor([float("nan"), 1.0, -float("nan")])
    weights = torch.empty(3, dtype=torch.bfloat16)
    packed = torch.empty(remainder.packed_numel(3), dtype=torch.int16)
    remainder.split(masters, weights, packed)
    rebuilt = remainder.rebuild(weights, packed)
    assert torch.isnan(rebuilt[0]) and torch.isnan(rebuilt[2]) and rebuilt[1] == 1.0
