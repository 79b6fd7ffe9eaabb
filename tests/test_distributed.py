"""Two CPU processes (gloo): DDP after initialize, and the overflow agreement over a process group.

Starting processes is the slow part, so one spawn runs every scenario and each rank writes what
it saw to a JSON file; the tests below then check one behaviour each.
"""
import gc
import json
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import amp
from amp._amp_state import _amp_state
from amp_common import batch, loss_of, named_masters, net, poison_grad, sgd

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

WORLD = 2


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def same_on_every_rank(tensors):
    flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def skipped(optimizer):
    return not bool(amp.last_step_applied(optimizer))


def ddp_scenario(rank):
    """O2 model in DDP; rank 1's loss is inf at step 2."""
    model = net()
    model, optimizer = amp.initialize(model, sgd(model.parameters()), opt_level="O2", verbosity=0)
    model = torch.nn.parallel.DistributedDataParallel(model)
    skips = []
    for step in range(4):
        loss = loss_of(model(batch(10 * step + rank)))
        if step == 2 and rank == 1:
            loss = loss * float("inf")
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        skips.append(skipped(optimizer))
    return dict(skips=skips, params_equal=same_on_every_rank(list(model.parameters())),
                masters_equal=same_on_every_rank(list(amp.master_params(optimizer))),
                scale=_amp_state.loss_scalers[0].loss_scale())


def seeded_apart_scenario(rank, opt_level):
    """Each rank builds its model from its own seed (as Apex's imagenet example does); DDP broadcasts rank 0's."""
    model = net(seed=rank)
    model, optimizer = amp.initialize(model, sgd(model.parameters()), opt_level=opt_level, verbosity=0)
    model = torch.nn.parallel.DistributedDataParallel(model)
    for step in range(5):
        with amp.scale_loss(loss_of(model(batch(10 * step + rank))), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return dict(params_equal=same_on_every_rank(list(model.parameters())),
                masters_equal=same_on_every_rank(list(amp.master_params(optimizer))))


def ddp_state_dict_scenario(rank):
    """An O2 model in DDP: its state dict holds the masters under 'module.', and loads them back."""
    model = net()
    model, optimizer = amp.initialize(model, sgd(model.parameters()), opt_level="O2", verbosity=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    for step in range(2):
        with amp.scale_loss(loss_of(ddp(batch(step))), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = ddp.state_dict()
    masters = named_masters(model, optimizer)
    other = net(seed=1)
    other, other_optimizer = amp.initialize(other, sgd(other.parameters()), opt_level="O2", verbosity=0)
    torch.nn.parallel.DistributedDataParallel(other).load_state_dict(state)
    loaded = named_masters(other, other_optimizer)
    return dict(saved=all(torch.equal(state["module." + name], m) for name, m in masters.items()),
                loaded=all(torch.equal(loaded[name], m) for name, m in masters.items()))


def group_scenario(rank, group):
    """No DDP; only rank 0's local grads hold an inf at step 1."""
    model = net()
    model, optimizer = amp.initialize(model, sgd(model.parameters()), opt_level="O2", verbosity=0,
                                      overflow_process_group=group)
    skips = []
    for step in range(3):
        with amp.scale_loss(loss_of(model(batch(step))), optimizer) as scaled_loss:
            scaled_loss.backward()
            if step == 1 and rank == 0:
                poison_grad(model.fc2.weight)
        optimizer.step()
        optimizer.zero_grad()
        skips.append(skipped(optimizer))
    return dict(skips=skips, masters_equal=same_on_every_rank(list(amp.master_params(optimizer))),
                scale=_amp_state.loss_scalers[0].loss_scale())


def wrapped_model_error():
    try:
        amp.initialize(torch.nn.parallel.DistributedDataParallel(net()), opt_level="O2", verbosity=0)
    except RuntimeError as error:
        return str(error)
    return None


def worker(rank, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    results = dict(ddp=ddp_scenario(rank),
                   seeded_apart={level: seeded_apart_scenario(rank, level) for level in ("O2", "O5")},
                   ddp_state_dict=ddp_state_dict_scenario(rank),
                   group_world=group_scenario(rank, dist.group.WORLD),
                   new_group=group_scenario(rank, dist.new_group(list(range(WORLD)))),
                   wrapped_error=wrapped_model_error())
    finish(rank, results, out_dir)


def finish(rank, results, out_dir):
    """Leave the group and write ``results``; exits the process."""
    # The scenarios' DDP objects (kept alive by reference cycles) must be gone before the group,
    # and no rank may tear its group down while the other still talks to it: gloo aborts the
    # process ("terminate called without an active exception") otherwise.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.json", "w") as file:
        json.dump(results, file)
    # The results are written: skip the interpreter's teardown, where a gloo thread still being
    # torn down can abort the process after everything has succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("distributed")
    mp.spawn(worker, args=(free_port(), str(out_dir)), nprocs=WORLD, join=True)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def test_o2_model_in_ddp_after_initialize_keeps_params_and_masters_identical_on_both_ranks(ranks):
    for result in ranks:
        assert result["ddp"]["params_equal"] and result["ddp"]["masters_equal"]


def test_o2_model_in_ddp_skips_on_both_ranks_when_one_rank_loss_is_inf(ranks):
    assert [r["ddp"]["skips"] for r in ranks] == [[False, False, True, False]] * WORLD
    assert [r["ddp"]["scale"] for r in ranks] == [2.0**15] * WORLD


@pytest.mark.parametrize("opt_level", ["O2", "O5"])
def test_ranks_seeded_apart_train_bit_identically_after_ddp_broadcasts_rank_0s_weights(ranks, opt_level):
    for result in ranks:
        assert result["seeded_apart"][opt_level] == dict(params_equal=True, masters_equal=True)


def test_state_dict_through_ddp_saves_and_loads_the_fp32_masters(ranks):
    for result in ranks:
        assert result["ddp_state_dict"] == dict(saved=True, loaded=True)


@pytest.mark.parametrize("group", ["group_world", "new_group"])
def test_overflow_process_group_makes_ranks_skip_together_when_one_rank_overflows(ranks, group):
    assert [r[group]["skips"] for r in ranks] == [[False, True, False]] * WORLD
    assert [r[group]["scale"] for r in ranks] == [2.0**15] * WORLD
    assert all(r[group]["masters_equal"] for r in ranks)


def test_model_already_in_ddp_is_an_error(ranks):
    for result in ranks:
        assert result["wrapped_error"] is not None and "AFTER the model" in result["wrapped_error"]
