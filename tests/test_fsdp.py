"""Two CPU processes (gloo): amp on models sharded by FSDP2 (``fully_shard``), and FSDP1's refusal.

One spawn runs every scenario; each rank writes what it saw to a JSON file and the tests below
check one behaviour each. Each level is compared with the same model trained by DDP at the same
level on the same per-rank batches.
"""
import functools
import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import amp
from amp._amp_state import _amp_state
from amp._compat import fsdp2
from amp_common import LOW_DTYPE, TOLERANCES, batch, loss_of, net, sgd
from test_distributed import finish, free_port, same_on_every_rank, skipped

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not dist.is_available() or fsdp2() is None,
                                 reason="torch.distributed or FSDP2 (fully_shard) is not available")]

WORLD = 2
STEPS = 3
# DDP averages the grads in the compute dtype at O2/O5 (its model is fp16/bf16) while FSDP2
# reduces them in fp32 (reduce_dtype), so the weights differ by roundings of that dtype: the
# suite's tolerance of one low-precision rounding (amp_common.TOLERANCES). At O0/O1/O4 both
# reduce fp32 grads of the same fp32 weights and differ only by the order of the sums.
FP32_SUMS = dict(rtol=1e-5, atol=1e-6)
TOLERANCE = {"O0": FP32_SUMS, "O1": FP32_SUMS, "O4": FP32_SUMS,
             "O2": TOLERANCES[torch.float16], "O5": TOLERANCES[torch.bfloat16]}


def sharded(model):
    """``fully_shard`` on each child (BatchNorm by itself), then on the root."""
    for child in model.children():
        fsdp2()[0](child)
    fsdp2()[0](model)
    return model


def full_weights(model):
    return {name: p.full_tensor().detach().float() for name, p in model.named_parameters()}


def compute_dtypes(model):
    """The dtype of each child's weight as its forward sees it."""
    seen = {}

    def note(name, module, args):
        seen.setdefault(name, str(module.weight.dtype))

    for name, child in model.named_children():
        child.register_forward_pre_hook(functools.partial(note, name))
    return seen


def train(model, optimizer, rank, steps=STEPS, start=0, poison_at=None):
    skips = []
    for step in range(start, start + steps):
        with amp.scale_loss(loss_of(model(batch(10 * step + rank))), optimizer) as scaled_loss:
            scaled_loss.backward()
            if step == poison_at and rank == 0:
                with torch.no_grad():  # the local shard of the grad, as a buggy model would
                    next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
        optimizer.step()
        optimizer.zero_grad()
        skips.append(skipped(optimizer))
    return skips


def level_scenario(rank, level):
    initial = full_weights(sharded(net()))
    model = sharded(net())
    seen = compute_dtypes(model)
    model, optimizer = amp.initialize(model, sgd(model.parameters()), opt_level=level, verbosity=0)
    train(model, optimizer, rank)
    ddp_model = net()
    ddp_model, ddp_optimizer = amp.initialize(ddp_model, sgd(ddp_model.parameters()), opt_level=level,
                                              verbosity=0)
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
    train(ddp, ddp_optimizer, rank)
    reference = {name: master.detach().float() for (name, _), master in
                 zip(ddp_model.named_parameters(), amp.master_params(ddp_optimizer))}
    weights = full_weights(model)
    local = [p.to_local() for p in model.parameters()]
    return dict(max_diff={name: (weights[name] - reference[name]).abs().max().item() for name in weights},
                close=all(torch.allclose(weights[n], reference[n], **TOLERANCE[level]) for n in weights),
                moved=not all(torch.equal(weights[n], initial[n]) for n in weights),
                compute=dict(seen),
                shard_dtypes=sorted({str(t.dtype) for t in local}),
                shard_numel=sum(t.numel() for t in local),
                full_numel=sum(p.numel() for p in model.parameters()))


def overflow_scenario(rank):
    """O2; only rank 0's local grad shard holds an inf at step 1."""
    model = sharded(net())
    model, optimizer = amp.initialize(model, sgd(model.parameters()), opt_level="O2", verbosity=0)
    train(model, optimizer, rank, steps=1)
    before = full_weights(model)
    skips = train(model, optimizer, rank, steps=1, start=1, poison_at=1)
    unchanged = all(torch.equal(before[n], w) for n, w in full_weights(model).items())
    skips += train(model, optimizer, rank, steps=1, start=2)
    return dict(skips=[False] + skips, unchanged=unchanged,
                scale=_amp_state.loss_scalers[0].loss_scale(),
                same_shards=same_on_every_rank(list(full_weights(model).values())))


def checkpoint_scenario(rank, directory):
    """O2: save after 2 steps through DCP, resume in a fresh run; equal to 4 uninterrupted steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def fresh(seed=0):
        model = sharded(net(seed))
        return amp.initialize(model, sgd(model.parameters()), opt_level="O2", verbosity=0)

    model, optimizer = fresh()
    train(model, optimizer, rank, steps=2)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory)
    amp_state = amp.state_dict()
    train(model, optimizer, rank, steps=2, start=2)
    uninterrupted = full_weights(model)

    model, optimizer = fresh(seed=1)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    amp.load_state_dict(amp_state)
    train(model, optimizer, rank, steps=2, start=2)
    resumed = full_weights(model)
    return dict(bit_exact=all(torch.equal(resumed[n], w) for n, w in uninterrupted.items()))


def error_of(function):
    try:
        function()
    except RuntimeError as error:
        return str(error)
    return None


def wrong_order_error(rank):
    def run():
        model = net()
        model, optimizer = amp.initialize(model, sgd(model.parameters()), opt_level="O2", verbosity=0)
        sharded(model)
        with amp.scale_loss(loss_of(model(batch(rank))), optimizer) as scaled_loss:
            scaled_loss.backward()
    return error_of(run)


def mixed_batchnorm_unit_error():
    def run():
        model = fsdp2()[0](net())  # the BatchNorm shares the root's unit with both Linears
        amp.initialize(model, sgd(model.parameters()), opt_level="O2", verbosity=0)
    return error_of(run)


def conflicting_policy_error():
    def run():
        model = net()
        policy = fsdp2()[2](param_dtype=torch.bfloat16)
        for child in model.children():
            fsdp2()[0](child, mp_policy=policy)
        fsdp2()[0](model, mp_policy=policy)
        amp.initialize(model, sgd(model.parameters()), opt_level="O2", verbosity=0)
    return error_of(run)


def optimizer_before_fully_shard_error():
    def run():
        model = net()
        optimizer = sgd(model.parameters())
        amp.initialize(sharded(model), optimizer, opt_level="O1", verbosity=0)
    return error_of(run)


def remainder_error():
    def run():
        model = sharded(net())
        amp.initialize(model, sgd(model.parameters()), opt_level="O5", master_weights="remainder", verbosity=0)
    return error_of(run)


def fsdp1_error():
    from torch.distributed.fsdp import FullyShardedDataParallel

    def run():
        model = FullyShardedDataParallel(net(), device_id=torch.device("cpu"))
        amp.initialize(model, sgd(model.parameters()), opt_level="O1", verbosity=0)
    return error_of(run)


def fsdp2_runs_here():
    """Whether this torch's FSDP2 runs on CPU (torch 2.3's needs CUDA streams), and why not."""
    try:
        sharded(torch.nn.Linear(2, 2))(torch.ones(1, 2))
    except RuntimeError as error:
        return f"FSDP2 of torch {torch.__version__} does not run on CPU: {str(error).splitlines()[0]}"
    return None


def worker(rank, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    unsupported = fsdp2_runs_here()
    results = dict(unsupported=unsupported)
    if unsupported is None:
        results.update(levels={level: level_scenario(rank, level) for level in TOLERANCE},
                       overflow=overflow_scenario(rank),
                       checkpoint=checkpoint_scenario(rank, f"{out_dir}/checkpoint"),
                       wrong_order=wrong_order_error(rank),
                       mixed_batchnorm=mixed_batchnorm_unit_error(),
                       conflicting_policy=conflicting_policy_error(),
                       optimizer_first=optimizer_before_fully_shard_error(),
                       fsdp1=fsdp1_error(),
                       remainder=remainder_error())
    finish(rank, results, out_dir)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fsdp")
    mp.spawn(worker, args=(free_port(), str(out_dir)), nprocs=WORLD, join=True)
    results = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    if results[0]["unsupported"]:
        pytest.skip(results[0]["unsupported"])
    return results


@pytest.mark.parametrize("level", list(TOLERANCE))
def test_each_level_with_fsdp2_trains_like_ddp_at_the_same_level(ranks, level):
    for result in ranks:
        assert result["levels"][level]["moved"]
        assert result["levels"][level]["close"], result["levels"][level]["max_diff"]


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_o2_o5_compute_in_low_precision_with_batchnorm_fp32(ranks, level):
    low = str(LOW_DTYPE[level])
    for result in ranks:
        assert result["levels"][level]["compute"] == dict(fc1=low, bn="torch.float32", fc2=low)


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_o2_o5_masters_are_the_fp32_shards_half_on_each_rank(ranks, level):
    for result in ranks:
        assert result["levels"][level]["shard_dtypes"] == ["torch.float32"]
    assert sum(r["levels"][level]["shard_numel"] for r in ranks) == ranks[0]["levels"][level]["full_numel"]
    assert all(r["levels"][level]["shard_numel"] < r["levels"][level]["full_numel"] for r in ranks)


def test_overflow_on_one_rank_skips_the_step_on_both(ranks):
    assert [r["overflow"]["skips"] for r in ranks] == [[False, True, False]] * WORLD
    assert all(r["overflow"]["unchanged"] and r["overflow"]["same_shards"] for r in ranks)
    assert [r["overflow"]["scale"] for r in ranks] == [2.0**15] * WORLD


def test_dcp_checkpoint_resumes_bit_exactly(ranks):
    assert all(r["checkpoint"]["bit_exact"] for r in ranks)


def test_fully_shard_after_initialize_is_an_error_naming_the_order(ranks):
    for result in ranks:
        assert "fully_shard was called on a model after amp.initialize" in result["wrong_order"]


def test_batchnorm_sharing_a_unit_with_other_layers_is_refused_under_keep_batchnorm_fp32(ranks):
    assert "Call fully_shard on each BatchNorm module by itself" in ranks[0]["mixed_batchnorm"]


def test_a_different_mp_policy_is_refused_with_the_one_to_set(ranks):
    message = ranks[0]["conflicting_policy"]
    assert "MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)" in message


def test_optimizer_built_before_fully_shard_is_refused(ranks):
    assert "build the optimizer on model.parameters() after fully_shard" in ranks[0]["optimizer_first"]


def test_fsdp1_is_refused_with_a_pointer_to_fsdp2(ranks):
    assert "Use FSDP2 instead" in ranks[0]["fsdp1"]


def test_remainder_masters_are_refused_with_fsdp2_saying_what_to_do(ranks):
    for result in ranks:
        assert "master_weights=True" in result["remainder"] and "fully_shard" in result["remainder"]
