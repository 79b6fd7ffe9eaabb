"""amp.parallel (apex.parallel under the drop-in): Apex's DDP arguments mapped onto torch's DDP or
refused, SyncBatchNorm on CPU/gloo, and DDP + SyncBatchNorm + LARC + amp O2 on two ranks.

One spawn of two gloo ranks runs every scenario; each rank writes what it saw to a JSON file.
"""
import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import amp
from amp.parallel import (
    LARC,
    DistributedDataParallel,
    Reducer,
    SyncBatchNorm,
    convert_syncbn_model,
    create_syncbn_process_group,
)
from amp.parallel.distributed import flat_dist_call
from amp_common import batch, loss_of, net
from test_distributed import WORLD, finish, free_port, same_on_every_rank

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def rank_grads(rank, module, dtype):
    """Backward of a loss that differs per rank."""
    loss = module(batch(rank).to(dtype)).float().pow(2).sum() * (rank + 1)
    loss.backward()


def local_grads(rank, dtype=torch.float32):
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(dtype)
    rank_grads(rank, model, dtype)
    return torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])


def reduced_grads(rank, dtype=torch.float32, **apex_kwargs):
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 3).to(dtype), **apex_kwargs)
    rank_grads(rank, model, dtype)
    return torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])


def reduction_scenario(rank):
    """Each Apex option's effect on the reduced grads, against the per-rank grads summed by hand."""
    mine = local_grads(rank)
    every = [torch.empty_like(mine) for _ in range(WORLD)]
    dist.all_gather(every, mine)
    total = sum(every)
    half_total = sum(local_grads(r, torch.float16).float() for r in range(WORLD))
    return dict(
        average=torch.allclose(reduced_grads(rank), total / WORLD, rtol=1e-6),
        sum=torch.allclose(reduced_grads(rank, gradient_average=False), total, rtol=1e-6),
        predivide_average=torch.allclose(reduced_grads(rank, gradient_predivide_factor=4.0),
                                         total / WORLD, rtol=1e-6),
        predivide_sum=torch.allclose(reduced_grads(rank, gradient_average=False, gradient_predivide_factor=4.0),
                                     total / 4, rtol=1e-6),
        # fp16 grads summed in fp32 and rounded once equal the fp32 sum of the fp16 grads, rounded.
        fp32_allreduce=torch.equal(reduced_grads(rank, torch.float16, allreduce_always_fp32=True),
                                   (half_total / WORLD).half().float()),
    )


def bucket_scenario():
    small = DistributedDataParallel(nn.Linear(4, 3), message_size=1000)
    delayed = DistributedDataParallel(nn.Linear(300, 300), delay_allreduce=True)
    need = sum(p.numel() * p.element_size() for p in delayed.parameters())
    return dict(small_bytes=small.bucket_bytes_cap, delayed_fits_all=delayed.bucket_bytes_cap >= need)


def syncbn_scenario(rank):
    """SyncBatchNorm on CPU equals BatchNorm over both ranks' rows: output, input grads, stats."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    reference = nn.BatchNorm1d(4)
    reference.load_state_dict(bn.state_dict())
    synced = convert_syncbn_model(nn.Sequential(bn))[0]
    inputs = [batch(10 + r, rows=6 + r).requires_grad_() for r in range(WORLD)]  # unequal sizes
    mine = inputs[rank].detach().clone().requires_grad_()
    out = synced(mine)
    (out * (rank + 1)).sum().backward()
    ref_out = reference(torch.cat(inputs))
    (ref_out * torch.cat([torch.full((6 + r, 1), r + 1.0) for r in range(WORLD)])).sum().backward()
    rows = slice(sum(6 + r for r in range(rank)), sum(6 + r for r in range(rank + 1)))
    return dict(
        converted=type(synced) is SyncBatchNorm,
        output=torch.allclose(out, ref_out[rows], atol=1e-5),
        input_grad=torch.allclose(mine.grad, inputs[rank].grad, atol=1e-5),
        running=torch.allclose(synced.running_mean, reference.running_mean, atol=1e-6)
        and torch.allclose(synced.running_var, reference.running_var, atol=1e-6),
    )


def apex_recipe_scenario(rank):
    """Apex's imagenet recipe: SyncBN, amp O2, Apex DDP, LARC; ranks seeded apart."""
    model = convert_syncbn_model(net(seed=rank))
    optimizer = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    model = DistributedDataParallel(model, delay_allreduce=True)
    losses = []
    for step in range(4):
        loss = loss_of(model(batch(2 * step + rank)))
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return dict(params_equal=same_on_every_rank(list(model.parameters())),
                masters_equal=same_on_every_rank(list(amp.master_params(optimizer))),
                buffers_equal=same_on_every_rank([b for b in model.buffers() if b.is_floating_point()]),
                finite=all(torch.isfinite(torch.tensor(losses)).tolist()))


def reducer_scenario(rank):
    """Apex's Reducer and flat_dist_call against the per-rank values gathered by hand."""
    model = net(seed=rank)
    rank0 = [p.detach().clone() for p in net(seed=0).parameters()]
    reducer = Reducer(model)
    broadcast = all(torch.equal(p, q) for p, q in zip(model.parameters(), rank0))
    loss_of(model(batch(rank))).backward()
    mine = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(mine) for _ in range(WORLD)]
    dist.all_gather(every, mine)
    reducer.reduce()
    averaged = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    tensors = [torch.full((3,), float(rank + 1)), torch.full((2,), float(rank + 1), dtype=torch.float16)]
    flat_dist_call(tensors, dist.broadcast, (1,))
    lonely = nn.Linear(2, 2)
    if rank == 0:
        lonely(torch.ones(1, 2)).sum().backward()
    try:
        Reducer(lonely).reduce()
        mismatch = "no error"
    except RuntimeError as error:
        mismatch = str(error)
    return dict(broadcast=broadcast, averaged=torch.allclose(averaged, sum(every) / WORLD, rtol=1e-6),
                flat_broadcast=all(torch.equal(t, torch.full_like(t, 2.0)) for t in tensors),
                mismatch="gradient on some ranks and none on others" in mismatch)


def syncbn_group_scenario(rank):
    """Groups of one rank: SyncBatchNorm then normalises over this rank's rows alone."""
    whole_world = create_syncbn_process_group(0)
    group = create_syncbn_process_group(1)
    bn = nn.BatchNorm1d(4)
    synced = SyncBatchNorm(4, process_group=group)
    x = batch(20 + rank)
    try:
        create_syncbn_process_group(WORLD + 1)
        indivisible = "no error"
    except ValueError as error:
        indivisible = str(error)
    return dict(whole_world=whole_world is None, alone=torch.allclose(synced(x), bn(x), atol=1e-6),
                indivisible=f"must divide the world size {WORLD}" in indivisible)


def worker(rank, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    results = dict(reduction=reduction_scenario(rank), buckets=bucket_scenario(),
                   syncbn=syncbn_scenario(rank), recipe=apex_recipe_scenario(rank),
                   reducer=reducer_scenario(rank), syncbn_group=syncbn_group_scenario(rank))
    finish(rank, results, out_dir)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("apex_parallel")
    mp.spawn(worker, args=(free_port(), str(out_dir)), nprocs=WORLD, join=True)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("option", ["average", "sum", "predivide_average", "predivide_sum", "fp32_allreduce"])
def test_apex_ddp_reduction_option_has_apex_effect_on_the_gradients(ranks, option):
    assert all(result["reduction"][option] for result in ranks)


@pytest.mark.slow
def test_apex_ddp_message_size_sets_the_bucket_size_in_gradient_elements(ranks):
    assert all(result["buckets"]["small_bytes"] == 1000 * 4 for result in ranks)


@pytest.mark.slow
def test_apex_ddp_delay_allreduce_puts_every_gradient_in_one_bucket(ranks):
    assert all(result["buckets"]["delayed_fits_all"] for result in ranks)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["converted", "output", "input_grad", "running"])
def test_syncbn_on_cpu_gloo_equals_batchnorm_over_every_rank(ranks, what):
    assert all(result["syncbn"][what] for result in ranks)


@pytest.mark.slow
def test_apex_recipe_ddp_syncbn_larc_o2_keeps_ranks_bit_identical(ranks):
    for result in ranks:
        assert result["recipe"] == dict(params_equal=True, masters_equal=True, buffers_equal=True, finite=True)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["broadcast", "averaged", "flat_broadcast", "mismatch"])
def test_reducer_broadcasts_rank0_params_and_averages_grads_on_demand(ranks, what):
    assert all(result["reducer"][what] for result in ranks)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["whole_world", "alone", "indivisible"])
def test_create_syncbn_process_group_gives_each_rank_its_groups_statistics(ranks, what):
    assert all(result["syncbn_group"][what] for result in ranks)


@pytest.mark.parametrize("group_size, match", [(-1, "int >= 0"), (1.5, "int >= 0"), (True, "int >= 0"),
                                               (2, "needs torch.distributed")])
def test_create_syncbn_process_group_refuses_bad_sizes_and_a_missing_group(group_size, match):
    with pytest.raises((ValueError, RuntimeError), match=match):
        create_syncbn_process_group(group_size)


def test_reducer_without_a_process_group_says_to_start_one():
    with pytest.raises(RuntimeError, match="init_process_group"):
        Reducer(nn.Linear(2, 2))


@pytest.mark.parametrize("argument, value, advice", [
    ("shared_param", True, "delay_allreduce=True"),
    ("allreduce_trigger_params", [], "message_size"),
    ("retain_allreduce_buffers", True, "param.grad"),
    ("num_allreduce_streams", 2, "drop the argument"),
    ("allreduce_communicators", (None, None), "process_group"),
    ("gradient_average_split_factor", 2.0, "gradient_predivide_factor"),
    ("prof", True, "torch.profiler"),
])
def test_apex_ddp_argument_that_cannot_be_honoured_is_refused_with_what_to_do(argument, value, advice):
    with pytest.raises(ValueError, match=f"{argument}=.*cannot be honoured.*{advice}"):
        DistributedDataParallel(nn.Linear(2, 2), **{argument: value})


@pytest.mark.parametrize("kwargs, match", [
    (dict(message_size=0), "message_size"),
    (dict(gradient_predivide_factor=0.0), "gradient_predivide_factor"),
    (dict(delay_allreduce="yes"), "delay_allreduce"),
    (dict(bucket_cap_mb=25), "message_size"),
])
def test_apex_ddp_bad_values_are_refused_before_anything_is_built(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        DistributedDataParallel(nn.Linear(2, 2), **kwargs)


def test_syncbn_refuses_fuse_relu_and_converts_nested_batchnorms_with_their_values():
    with pytest.raises(ValueError, match="torch.relu"):
        SyncBatchNorm(4, fuse_relu=True)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Sequential(nn.BatchNorm2d(4)))
    with torch.no_grad():
        model[1][0].running_mean.fill_(0.5)
        model[1][0].weight.fill_(2.0)
    model.eval()
    expected = model(torch.ones(2, 3, 2, 2))
    converted = convert_syncbn_model(model)
    assert converted is model and type(model[1][0]) is SyncBatchNorm and not model[1][0].training
    assert torch.equal(converted(torch.ones(2, 3, 2, 2)), expected)
