"""amp.parallel (apex.parallel under the drop-in): Apex's DDP arguments mapped onto torch's DDP or
refused, SyncBatchNorm on CPU/gloo, and DDP + SyncBatchNorm + LARC + amp O2 on two ranks.

One spawn of two gloo ranks runs every scenario; each rank writes what it saw to a JSON file.
"""
import copy
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
from amp_common import assert_identical, batch, loss_of, net
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


# (N, H, W, C) of Apex's channel_last inputs, rank 0's N; H == C would hide normalising dim 1.
CHANNEL_LAST_SHAPES = {"h_equals_c": (3, 3, 5, 3), "h_differs_from_c": (3, 6, 5, 3)}


def bn_pair(channels, **sync_kwargs):
    """A SyncBatchNorm and a torch BatchNorm2d with the same random affine parameters."""
    torch.manual_seed(0)
    reference = nn.BatchNorm2d(channels)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.uniform_(-0.5, 0.5)
    synced = SyncBatchNorm(channels, **sync_kwargs)
    synced.load_state_dict(reference.state_dict())
    return synced, reference


def channel_last_inputs(shape, ranks):
    """Per rank an (N + rank, H, W, C) input, channels last; unequal row counts."""
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(shape[0] + r, *shape[1:], generator=generator) for r in range(ranks)]


def compare_channel_last(synced, reference, inputs, rank):
    """Output, input/weight/bias grads and running stats of ``synced`` on rank ``rank``'s input against
    ``reference`` on every rank's input, moved to (N, C, H, W); the weights' grads summed over ranks."""
    mine = inputs[rank].clone().requires_grad_()
    out = synced(mine)
    (out * (rank + 1)).sum().backward()
    everything = torch.cat(inputs).requires_grad_()
    ref_out = reference(everything.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    weights = torch.cat([torch.full((len(x), 1, 1, 1), r + 1.0) for r, x in enumerate(inputs)])
    (ref_out * weights).sum().backward()
    rows = slice(sum(len(x) for x in inputs[:rank]), sum(len(x) for x in inputs[:rank + 1]))
    param_grads = torch.cat([synced.weight.grad, synced.bias.grad])
    if len(inputs) > 1:
        dist.all_reduce(param_grads)
    close = dict(rtol=1e-5, atol=1e-5)
    return dict(
        output=out.shape == mine.shape and torch.allclose(out, ref_out[rows], **close),
        input_grad=torch.allclose(mine.grad, everything.grad[rows], **close),
        param_grads=torch.allclose(param_grads, torch.cat([reference.weight.grad, reference.bias.grad]), **close),
        running=torch.allclose(synced.running_mean, reference.running_mean, **close)
        and torch.allclose(synced.running_var, reference.running_var, **close),
        eval=torch.allclose(synced.eval()(inputs[rank]),
                            reference.eval()(inputs[rank].permute(0, 3, 1, 2)).permute(0, 2, 3, 1), **close),
    )


def syncbn_channel_last_scenario(rank):
    """SyncBatchNorm(channel_last=True), synchronised: the channels are the inputs' last dimension."""
    results = {}
    for name, shape in CHANNEL_LAST_SHAPES.items():
        synced, reference = bn_pair(shape[-1], channel_last=True)
        results[name] = compare_channel_last(synced, reference, channel_last_inputs(shape, WORLD), rank)
    return results


def empty_batch_step(synced, reference, inputs, rank):
    """One training step of ``synced`` on rank ``rank``'s rows against ``reference`` on all of them."""
    mine = inputs[rank].clone().requires_grad_()
    out = synced(mine)
    out.sum().backward()
    everything = torch.cat(inputs).requires_grad_()
    ref_out = reference(everything)
    ref_out.sum().backward()
    rows = slice(sum(len(x) for x in inputs[:rank]), sum(len(x) for x in inputs[:rank + 1]))
    param_grads = torch.cat([synced.weight.grad, synced.bias.grad])
    dist.all_reduce(param_grads)
    return dict(
        output=out.shape == mine.shape and torch.allclose(out, ref_out[rows], atol=1e-5),
        input_grad=mine.grad is not None and torch.allclose(mine.grad, everything.grad[rows], atol=1e-6),
        param_grads=torch.allclose(param_grads, torch.cat([reference.weight.grad, reference.bias.grad]), atol=1e-6),
        running=torch.allclose(synced.running_mean, reference.running_mean, atol=1e-6)
        and torch.allclose(synced.running_var, reference.running_var, atol=1e-6)
        and torch.equal(synced.num_batches_tracked, reference.num_batches_tracked),
    )


def syncbn_empty_scenario(rank):
    """A step where no rank has a row, between ordinary steps: as torch's BatchNorm on the same rows."""
    results = {}
    for momentum in (0.1, None):
        reference = nn.BatchNorm1d(4, momentum=momentum)
        synced = convert_syncbn_model(copy.deepcopy(reference))
        steps = {}
        for step, rows in enumerate([5, 0, 3]):
            inputs = [batch(30 + 10 * step + r, rows=rows) for r in range(WORLD)]
            steps[f"rows_{rows}"] = empty_batch_step(synced, reference, inputs, rank)
            synced.zero_grad()
            reference.zero_grad()
        results[f"momentum_{momentum}"] = steps
    return results


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
                   reducer=reducer_scenario(rank), syncbn_group=syncbn_group_scenario(rank),
                   syncbn_channel_last=syncbn_channel_last_scenario(rank), syncbn_empty=syncbn_empty_scenario(rank))
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
@pytest.mark.parametrize("what", ["output", "input_grad", "param_grads", "running", "eval"])
@pytest.mark.parametrize("shape", CHANNEL_LAST_SHAPES)
def test_syncbn_channel_last_normalises_the_last_dimension_over_every_rank(ranks, shape, what):
    assert all(result["syncbn_channel_last"][shape][what] for result in ranks)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["output", "input_grad", "param_grads", "running"])
@pytest.mark.parametrize("momentum", ["momentum_0.1", "momentum_None"])
def test_syncbn_step_where_no_rank_has_a_row_leaves_the_running_stats_as_batchnorm_does(ranks, momentum, what):
    # Before and after the empty step the statistics are taken over rows again; the NaN the empty
    # step used to write into the running statistics would stay there.
    for result in ranks:
        assert all(step[what] for step in result["syncbn_empty"][momentum].values())


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


@pytest.mark.parametrize("shape", CHANNEL_LAST_SHAPES.values(), ids=CHANNEL_LAST_SHAPES)
def test_syncbn_channel_last_normalises_the_last_dimension_as_apex_did(shape):
    synced, reference = bn_pair(shape[-1], channel_last=True)
    assert all(compare_channel_last(synced, reference, channel_last_inputs(shape, 1), 0).values())


def test_syncbn_channel_last_is_channel_first_for_2d_inputs_as_apex_did():
    synced, reference = bn_pair(3, channel_last=True)
    x = batch(3)[:, :3]
    assert torch.equal(synced(x), nn.functional.batch_norm(
        x, None, None, reference.weight, reference.bias, training=True, eps=reference.eps))


def test_convert_syncbn_model_passes_channel_last_on():
    model = convert_syncbn_model(nn.Sequential(nn.BatchNorm2d(3)), channel_last=True)
    x = torch.randn(2, 4, 5, 3)
    assert torch.allclose(model(x), nn.BatchNorm2d(3)(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1), atol=1e-6)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_syncbn_on_an_empty_batch_in_one_process_does_what_batchnorm_does(momentum):
    synced = SyncBatchNorm(4, momentum=momentum)
    reference = nn.BatchNorm1d(4, momentum=momentum)
    with torch.no_grad():
        for bn in (synced, reference):
            bn.running_mean.fill_(0.5)
            bn.weight.fill_(2.0)
    for bn in (synced, reference):
        x = torch.empty(0, 4, requires_grad=True)
        out = bn(x)
        out.sum().backward()
        assert out.shape == (0, 4) and x.grad.shape == (0, 4)
    assert_identical([synced.running_mean, synced.running_var, synced.num_batches_tracked,
                      synced.weight.grad, synced.bias.grad],
                     [reference.running_mean, reference.running_var, reference.num_batches_tracked,
                      reference.weight.grad, reference.bias.grad])


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
