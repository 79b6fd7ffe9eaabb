"""amp.state_dict / load_state_dict with several live amp.initialize runs in one process."""
import gc
import io

import pytest
import torch

import amp
from amp_common import adam, assert_identical, initialized, sgd, snapshot, train_step

STEPS = 6
SAVE_AFTER = 3
# Two O2 runs whose scales and counters end up different: A skips step 1 (scale 2**15), B has two
# losses (loss step % 2) and skips step 2 on loss 0 (hysteresis 2: its tracker drops, its scale stays).
RUNS = {
    "A": dict(opt_level="O2", make_optimizer=sgd, growth_interval=2),
    "B": dict(opt_level="O2", make_optimizer=adam, seed=1, num_losses=2, hysteresis=2, growth_interval=5),
}
INJECT = {"A": {1}, "B": {2}}


def start(names):
    return {name: initialized(**RUNS[name]) for name in names}


def train(runs, steps):
    for step in steps:
        for name, (model, optimizer) in runs.items():
            loss_id = step % 2 if name == "B" else 0
            train_step(model, optimizer, step, inject=step in INJECT[name], loss_id=loss_id)


def state(runs):
    return {name: snapshot(model, optimizer) for name, (model, optimizer) in runs.items()}


def round_trip(checkpoint):
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def checkpoint_of(runs):
    objects = {name: dict(model=model.state_dict(), optimizer=optimizer.state_dict())
               for name, (model, optimizer) in runs.items()}
    return round_trip(dict(objects, amp=amp.state_dict()))


def scales(runs):
    return {name: [amp.loss_scaler(i, optimizer=optimizer).state_dict()
                   for i in range(len(optimizer._amp_stash.context.loss_scalers))]
            for name, (_, optimizer) in runs.items()}


@pytest.mark.parametrize("order", [("A", "B"), ("B", "A")], ids=["A_first", "B_first"])
def test_two_runs_resume_bit_identical_to_an_uninterrupted_process(order):
    runs = start(order)
    train(runs, range(STEPS))
    expected, expected_scales = state(runs), scales(runs)

    runs = start(order)
    train(runs, range(SAVE_AFTER))
    checkpoint = checkpoint_of(runs)
    assert list(checkpoint["amp"]) == ["run0", "run1"]

    runs = start(order)  # the saved process's objects are gone, as after a restart
    for name, (model, optimizer) in runs.items():
        model.load_state_dict(checkpoint[name]["model"])
        optimizer.load_state_dict(checkpoint[name]["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    train(runs, range(SAVE_AFTER, STEPS))
    assert scales(runs) == expected_scales
    assert_identical(state(runs), expected)


def test_each_run_saves_its_own_scale():
    runs = start("AB")
    train(runs, range(SAVE_AFTER))
    saved = amp.state_dict()
    assert saved["run0"]["loss_scaler0"]["loss_scale"] == 2.0**15  # A skipped once
    assert saved["run1"]["loss_scaler0"]["hysteresis_tracker"] == 1  # B tolerated one overflow
    assert saved["run1"]["loss_scaler0"]["loss_scale"] == 2.0**16


def test_a_checkpoint_of_two_runs_is_refused_by_the_runs_in_the_other_order():
    runs = start("AB")
    train(runs, range(SAVE_AFTER))
    saved = amp.state_dict()
    del runs
    runs = start("BA")
    before = scales(runs)
    with pytest.raises(RuntimeError, match=r"(?s)num_losses=1.*num_losses=2.*holds 2 run\(s\)"):
        amp.load_state_dict(saved)
    assert scales(runs) == before


@pytest.mark.parametrize("live", [("A",), ("A", "B", "A")], ids=["fewer_runs", "more_runs"])
def test_a_checkpoint_of_two_runs_is_refused_by_another_number_of_runs(live):
    runs = start("AB")
    saved = amp.state_dict()
    del runs
    live_runs = [initialized(**RUNS[name]) for name in live]
    before = [amp.loss_scaler(optimizer=optimizer).state_dict() for _, optimizer in live_runs]
    with pytest.raises(RuntimeError, match=rf"holds 2 run\(s\).*{len(live)} run\(s\): O2"):
        amp.load_state_dict(saved)
    assert [amp.loss_scaler(optimizer=optimizer).state_dict() for _, optimizer in live_runs] == before


def test_a_dynamic_run_checkpoint_is_refused_by_a_static_run_in_its_place():
    runs = [initialized("O2"), initialized("O5")]
    saved = amp.state_dict()
    del runs
    runs = [initialized("O5"), initialized("O2")]  # noqa: F841  (kept in use)
    with pytest.raises(RuntimeError, match="saved dynamic but the live one is static"):
        amp.load_state_dict(saved)


def test_a_single_run_checkpoint_loads_into_the_new_run_while_the_saved_run_is_still_bound():
    model, optimizer = initialized("O2")
    train_step(model, optimizer, 0, inject=True)
    saved = amp.state_dict()
    assert list(saved) == ["loss_scaler0"] and saved["loss_scaler0"]["loss_scale"] == 2.0**15
    amp.loss_scaler(optimizer=optimizer).set_scale(2.0**10)  # the saved run goes on changing
    other_model, other_optimizer = initialized("O2", seed=1)
    amp.load_state_dict(saved)
    assert amp.loss_scale(optimizer=other_optimizer) == 2.0**15
    assert amp.loss_scale(optimizer=optimizer) == 2.0**10


def test_a_single_run_checkpoint_is_refused_while_two_runs_in_use_have_not_stepped():
    saved = amp.state_dict(optimizer=initialized("O2")[1])
    runs = [initialized("O2", seed=1), initialized("O2", seed=2)]
    with pytest.raises(RuntimeError, match="ambiguous.*optimizer="):
        amp.load_state_dict(saved)
    assert [amp.loss_scale(optimizer=optimizer) for _, optimizer in runs] == [2.0**16, 2.0**16]


def test_apexs_resume_recipe_in_one_process_matches_the_uninterrupted_run_it_was_saved_from():
    model, optimizer = initialized("O2", make_optimizer=adam)
    train(dict(A=(model, optimizer)), range(SAVE_AFTER))
    checkpoint = round_trip(dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
                                 amp=amp.state_dict()))
    train(dict(A=(model, optimizer)), range(SAVE_AFTER, STEPS))  # the uninterrupted run, kept bound
    resumed_model, resumed_optimizer = initialized("O2", make_optimizer=adam, seed=5)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    train(dict(A=(resumed_model, resumed_optimizer)), range(SAVE_AFTER, STEPS))
    assert_identical(snapshot(resumed_model, resumed_optimizer), snapshot(model, optimizer))
    assert amp.loss_scaler(optimizer=resumed_optimizer).state_dict() == \
        amp.loss_scaler(optimizer=optimizer).state_dict()


def test_state_dict_saves_apexs_format_for_the_run_in_use_while_an_earlier_run_is_still_bound():
    earlier = initialized("O2")
    train_step(*earlier, 0)
    model, optimizer = initialized("O2", seed=1)
    assert list(amp.state_dict()) == ["loss_scaler0"]
    train_step(model, optimizer, 0, inject=True)
    assert amp.state_dict() == amp.state_dict(optimizer=optimizer)
    train_step(*earlier, 1)  # both runs train: both are saved
    assert list(amp.state_dict()) == ["run0", "run1"]


def test_runs_initialized_together_are_saved_together_before_either_steps():
    runs = start("AB")
    assert list(amp.state_dict()) == ["run0", "run1"]
    train(runs, range(1))
    assert list(amp.state_dict()) == ["run0", "run1"]


def test_the_checkpoints_format_does_not_wait_for_the_cycle_collector():
    gc.disable()
    try:
        model, optimizer = initialized("O2")
        train_step(model, optimizer, 0)
        cycle = [model, optimizer]
        cycle.append(cycle)  # garbage once dropped, freed only by the cycle collector
        del model, optimizer, cycle
        initialized("O2", seed=1)  # its objects are dropped at once, without the collector
        kept = initialized("O2", num_losses=2, seed=2)
        assert list(amp.state_dict()) == ["loss_scaler0", "loss_scaler1"]
        gc.collect()
        assert list(amp.state_dict()) == ["loss_scaler0", "loss_scaler1"]
    finally:
        gc.enable()
    del kept


def test_initialize_does_not_run_the_cycle_collector():
    collections = []

    def note(phase, info):
        if phase == "start":
            collections.append(info["generation"])
    gc.callbacks.append(note)
    try:
        initialized("O2")
        initialized("O1", seed=1)
    finally:
        gc.callbacks.remove(note)
    assert 2 not in collections  # a full collection walks every object of the process


def test_optimizer_selects_the_run_to_save_and_load():
    runs = start("AB")
    train(runs, range(SAVE_AFTER))
    (_, optimizer_a), (_, optimizer_b) = runs["A"], runs["B"]
    saved_a, saved_both = amp.state_dict(optimizer=optimizer_a), amp.state_dict()
    assert saved_a == saved_both["run0"]
    fresh_model, fresh_optimizer = initialized(**RUNS["A"])
    amp.load_state_dict(saved_a, optimizer=fresh_optimizer)
    assert amp.state_dict(optimizer=fresh_optimizer) == saved_a
    with pytest.raises(RuntimeError, match=r"state_dict\['run1'\]"):
        amp.load_state_dict(saved_both, optimizer=optimizer_b)


def test_a_run_whose_objects_are_gone_is_neither_saved_nor_blocks_a_load():
    model, optimizer = initialized("O2", num_losses=2)
    saved = amp.state_dict()
    del model, optimizer
    initialized("O1")  # also gone at once: its objects are not kept
    model, optimizer = initialized("O2", num_losses=2, seed=1)
    assert list(amp.state_dict()) == ["loss_scaler0", "loss_scaler1"]
    amp.load_state_dict(saved)


def test_with_no_run_in_use_state_dict_saves_the_latest_runs_scalers_as_apex_did():
    model, optimizer = initialized("O2", num_losses=2)
    train_step(model, optimizer, 0, inject=True)
    expected = amp.state_dict()
    del model, optimizer
    assert amp.state_dict() == expected and list(expected) == ["loss_scaler0", "loss_scaler1"]


def test_with_no_run_in_use_state_dict_refuses_when_another_run_stepped_after_the_latest():
    runs = start("AB")
    train(runs, range(SAVE_AFTER))  # A steps after B's initialize: both were in use
    del runs
    with pytest.raises(RuntimeError, match="ambiguous"):
        amp.state_dict()
