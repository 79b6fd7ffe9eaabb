"""Two CPU processes (gloo): DDP after initialize, other ways of syncing ranks, and the overflow
agreement over a process group.

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

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")]

WORLD = 2


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def same_on_every_rank(tensors):
    flat = torch.cat([t.detach().clone().float().reshape(-1) for t in tensors])  # clone: a remainder master's value
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


def seeded_apart_scenario(rank, opt_level, return_values=False, **options):
    """Each rank builds its model from its own seed (as Apex's imagenet example does); DDP broadcasts rank 0's."""
    model = net(seed=rank)
    model, optimizer = amp.initialize(model, sgd(model.parameters()), opt_level=opt_level, verbosity=0, **options)
    model = torch.nn.parallel.DistributedDataParallel(model)
    for step in range(5):
        with amp.scale_loss(loss_of(model(batch(10 * step + rank))), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    result = dict(params_equal=same_on_every_rank(list(model.parameters())),
                  masters_equal=same_on_every_rank(list(amp.master_params(optimizer))))
    if return_values:
        result["masters"] = [m.detach().clone() for m in amp.master_params(optimizer)]
    return result


def remainder_ddp_scenario(rank):
    """O5 with remainders in DDP, ranks seeded apart: identical on both ranks, and bit for bit the
    run with fp32 masters (every rank's)."""
    runs = [seeded_apart_scenario(rank, "O5", master_weights=mw, return_values=True) for mw in (True, "remainder")]
    same_as_fp32 = all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(runs[0]["masters"], runs[1]["masters"]))
    return dict(params_equal=runs[1]["params_equal"], masters_equal=runs[1]["masters_equal"], same_as_fp32=same_as_fp32)


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


def _broadcast_params(model, through_data):
    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param.data if through_data else param, 0)


def _train(model, optimizer, steps, first=0):
    """The same data on every rank: ranks that start alike must stay bit-identical without DDP."""
    for step in range(first, first + steps):
        with amp.scale_loss(loss_of(model(batch(step))), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _identical_on_every_rank(model, optimizer):
    return dict(params_equal=same_on_every_rank(list(model.parameters())),
                masters_equal=same_on_every_rank(list(amp.master_params(optimizer))))


def _initialized(seed, opt_level):
    """``opt_level`` "O5 remainder" is O5 with master_weights="remainder"."""
    model = net(seed=seed)
    options = dict(master_weights="remainder") if opt_level == "O5 remainder" else {}
    return amp.initialize(model, sgd(model.parameters()), opt_level=opt_level.split()[0], verbosity=0, **options)


def broadcast_scenario(rank, opt_level, through_data):
    """Ranks seeded apart sync with dist.broadcast after initialize (as Horovod and Apex's DDP do)."""
    model, optimizer = _initialized(rank, opt_level)
    _broadcast_params(model, through_data)
    _train(model, optimizer, 4)
    return _identical_on_every_rank(model, optimizer)


def broadcast_after_steps_scenario(opt_level, rank):
    """Ranks in step for two steps; then rank 0 loads a checkpoint and broadcasts its weights."""
    model, optimizer = _initialized(0, opt_level)
    _train(model, optimizer, 2)
    if rank == 0:
        model.load_state_dict(net(seed=5).state_dict())
    _broadcast_params(model, through_data=True)
    _train(model, optimizer, 3, first=2)
    return _identical_on_every_rank(model, optimizer)


def state_dict_broadcast_scenario(opt_level, rank):
    """Ranks seeded apart; rank 0's model.state_dict() (its fp32 masters) is broadcast and loaded."""
    model, optimizer = _initialized(rank, opt_level)
    state = [model.state_dict()]
    dist.broadcast_object_list(state, 0)
    if rank != 0:
        model.load_state_dict(state[0])
    _train(model, optimizer, 4)
    return _identical_on_every_rank(model, optimizer)


def one_rank_group_scenario(rank, own_group):
    """A broadcast within a group of this rank alone, after two steps: other ranks need not agree,
    so the masters keep their fp32 bits, as in a run without the broadcast."""
    masters = []
    for broadcast in (False, True):
        model, optimizer = _initialized(0, "O2")
        _train(model, optimizer, 2)
        if broadcast:
            with torch.no_grad():
                for param in model.parameters():
                    dist.broadcast(param.data, rank, group=own_group)
        _train(model, optimizer, 2, first=2)
        masters.append([m.detach() for m in amp.master_params(optimizer)])
    return all(torch.equal(a, b) for a, b in zip(*masters))


def grad_collective_scenario():
    """A collective on the grads inside the block (as hand-written data parallelism does) writes
    no param: the masters keep their fp32 bits, as in a run without it."""
    masters = []
    for sync_grads in (False, True):
        model, optimizer = _initialized(0, "O2")
        for step in range(3):
            with amp.scale_loss(loss_of(model(batch(step))), optimizer) as scaled_loss:
                scaled_loss.backward()
                if sync_grads:
                    for param in model.parameters():
                        dist.broadcast(param.grad, 0)  # the same grads on every rank: values unchanged
            optimizer.step()
            optimizer.zero_grad()
        masters.append([m.detach() for m in amp.master_params(optimizer)])
    return all(torch.equal(a, b) for a, b in zip(*masters))


def synced_scenarios(rank):
    """Every way of syncing ranks without DDP, at O2 and O5: ``{way: {level: result}}``."""
    ways = {"broadcast(p)": lambda level: broadcast_scenario(rank, level, through_data=False),
            "broadcast(p.data)": lambda level: broadcast_scenario(rank, level, through_data=True),
            "broadcast after steps": lambda level: broadcast_after_steps_scenario(level, rank),
            "state_dict broadcast": lambda level: state_dict_broadcast_scenario(level, rank)}
    return {way: {level: scenario(level) for level in ("O2", "O5", "O5 remainder")} for way, scenario in ways.items()}


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
    own_groups = [dist.new_group([r]) for r in range(WORLD)]  # every rank creates every group
    results = dict(ddp=ddp_scenario(rank),
                   seeded_apart={level: seeded_apart_scenario(rank, level) for level in ("O2", "O5")},
                   remainder_ddp=remainder_ddp_scenario(rank),
                   ddp_state_dict=ddp_state_dict_scenario(rank),
                   synced=synced_scenarios(rank),
                   one_rank_group=one_rank_group_scenario(rank, own_groups[rank]),
                   grad_collective=grad_collective_scenario(),
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


def test_remainder_masters_in_ddp_train_bit_identically_on_both_ranks_and_as_fp32_masters(ranks):
    for result in ranks:
        assert result["remainder_ddp"] == dict(params_equal=True, masters_equal=True, same_as_fp32=True)


@pytest.mark.parametrize("opt_level", ["O2", "O5", "O5 remainder"])
@pytest.mark.parametrize("way", ["broadcast(p)", "broadcast(p.data)", "broadcast after steps",
                                 "state_dict broadcast"])
def test_ranks_synced_without_ddp_train_bit_identically(ranks, way, opt_level):
    for result in ranks:
        assert result["synced"][way][opt_level] == dict(params_equal=True, masters_equal=True)


def test_a_broadcast_within_a_one_rank_group_keeps_the_fp32_masters(ranks):
    assert [r["one_rank_group"] for r in ranks] == [True] * WORLD


def test_a_collective_on_the_grads_leaves_the_fp32_masters_alone(ranks):
    assert [r["grad_collective"] for r in ranks] == [True] * WORLD


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
