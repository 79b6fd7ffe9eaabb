"""scale_loss blocks sharing a dynamic loss scaler: one thread at a time; nested blocks of one thread
each unscale by the scale they multiplied their loss by.

The overlaps are made certain with events and barriers, not left to timing. Each concurrent run is
compared with the same runs trained one after the other in one thread.
"""
import threading

import pytest

import amp
from amp_common import assert_identical, batch, loss_of, net, poison_grad, sgd, snapshot

# Only guards against a hang if a thread dies before it reaches a barrier; never a timing check.
WAIT_S = 30


def _pair(opt_level, separate=False, **kwargs):
    """Two models and their optimizers; one initialize call unless ``separate``."""
    models = [net(seed=1), net(seed=2)]
    optimizers = [sgd(m.parameters()) for m in models]
    if separate:
        return tuple(zip(*(amp.initialize(m, o, opt_level=opt_level, verbosity=0)
                           for m, o in zip(models, optimizers))))
    return amp.initialize(models, optimizers, opt_level=opt_level, verbosity=0, **kwargs)


def _step(model, optimizer, step, loss_id, inside=None, overflow_at=None):
    """One step of the recipe; ``inside`` runs in the block before the backward."""
    loss = loss_of(model(batch(step)))
    with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled_loss:
        if inside is not None:
            inside()
        scaled_loss.backward()
        if step == overflow_at:
            poison_grad(model.fc1.weight)
    optimizer.step()
    optimizer.zero_grad()


def _state(models, optimizers):
    return [snapshot(m, o) for m, o in zip(models, optimizers)]


def _in_threads(*targets):
    errors = []

    def run(target):
        try:
            target()
        except BaseException as error:  # surfaced by the test
            errors.append(error)

    threads = [threading.Thread(target=run, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_block_on_a_scaler_held_by_another_thread_raises_and_changes_nothing(opt_level):
    models, optimizers = _pair(opt_level)
    expected_models, expected_optimizers = _pair(opt_level)
    _step(expected_models[0], expected_optimizers[0], 0, 0)
    opened, tried = threading.Event(), threading.Event()

    def hold_the_scaler():
        opened.set()
        assert tried.wait(WAIT_S)

    def second_thread():
        assert opened.wait(WAIT_S)
        try:
            loss = loss_of(models[1](batch(1)))
            before = snapshot(models[1], optimizers[1])
            scale = amp.loss_scale(0, optimizers[1])
            with pytest.raises(RuntimeError, match="num_losses=.*loss_id=.*amp.initialize once per thread"):
                with amp.scale_loss(loss, optimizers[1]):
                    pass
            assert_identical(snapshot(models[1], optimizers[1]), before)
            assert optimizers[1]._amp_stash.in_scale_loss is False
            assert amp.loss_scale(0, optimizers[1]) == scale
        finally:
            tried.set()

    errors = _in_threads(lambda: _step(models[0], optimizers[0], 0, 0, inside=hold_the_scaler), second_thread)
    assert not errors, errors
    # The holder was not disturbed, and the scaler is free again once its block exited.
    assert_identical(snapshot(models[0], optimizers[0]), snapshot(expected_models[0], expected_optimizers[0]))
    _step(models[1], optimizers[1], 1, 0)


@pytest.mark.parametrize("way", ["a loss_id per thread", "an initialize per thread"])
def test_threads_with_their_own_scalers_train_concurrently_like_one_after_the_other(way):
    kwargs = dict(num_losses=2) if way == "a loss_id per thread" else dict(separate=True)
    models, optimizers = _pair("O2", **kwargs)
    expected_models, expected_optimizers = _pair("O2", **kwargs)
    loss_ids = [0, 1] if way == "a loss_id per thread" else [0, 0]
    overflow_at = [2, None]  # the first run's scale halves once, the second's stays
    for index in (0, 1):
        for step in range(4):
            _step(expected_models[index], expected_optimizers[index], step, loss_ids[index],
                  overflow_at=overflow_at[index])
    both_open = threading.Barrier(2, timeout=WAIT_S)

    def train(index):
        for step in range(4):
            _step(models[index], optimizers[index], step, loss_ids[index], inside=both_open.wait,
                  overflow_at=overflow_at[index])

    errors = _in_threads(lambda: train(0), lambda: train(1))
    assert not errors, errors
    assert_identical(_state(models, optimizers), _state(expected_models, expected_optimizers))
    assert [amp.loss_scale(i, o) for i, o in zip(loss_ids, optimizers)] == [2.0**15, 2.0**16]


def test_nested_blocks_of_one_thread_on_one_scaler_over_different_optimizers_still_work():
    models, optimizers = _pair("O2")
    expected_models, expected_optimizers = _pair("O2")
    for index in (0, 1):
        with amp.scale_loss(loss_of(expected_models[index](batch(index))), expected_optimizers[index]) as loss:
            loss.backward()
    with amp.scale_loss(loss_of(models[0](batch(0))), optimizers[0]) as outer:
        outer.backward()
        with amp.scale_loss(loss_of(models[1](batch(1))), optimizers[1]) as inner:
            inner.backward()
    grads = [[p.grad for p in amp.master_params(o)] for o in optimizers]
    assert_identical(grads, [[p.grad for p in amp.master_params(o)] for o in expected_optimizers])


def test_an_outer_block_unscales_by_its_own_scale_after_a_nested_block_changed_the_scale():
    models, optimizers = _pair("O2")
    expected_models, expected_optimizers = _pair("O2")
    with amp.scale_loss(loss_of(expected_models[0](batch(0))), expected_optimizers[0]) as loss:
        loss.backward()
    with amp.scale_loss(loss_of(models[0](batch(0))), optimizers[0]) as outer:
        outer.backward()
        with amp.scale_loss(loss_of(models[1](batch(1))), optimizers[1]) as inner:
            inner.backward()
            poison_grad(models[1].fc1.weight)
        assert amp.loss_scale(0, optimizers[0]) == 2.0**15  # the outer loss was multiplied by 2**16
    assert_identical([p.grad for p in amp.master_params(optimizers[0])],
                     [p.grad for p in amp.master_params(expected_optimizers[0])])


def _fused_sgd(params):
    return amp.optimizers.FusedSGD(params, lr=0.1, momentum=0.9, materialize_master_grads=False)


def _fused_adam(params):
    return amp.optimizers.FusedAdam(params, lr=1e-3, materialize_master_grads=False)


@pytest.mark.parametrize("make_optimizer", [sgd, _fused_sgd, _fused_adam], ids=["SGD", "FusedSGD", "FusedAdam"])
def test_an_outer_backward_after_a_nested_block_changed_the_scale_steps_as_if_alone(make_optimizer):
    # The outer loss still needs, in its backward, the scale it was multiplied by: the nested
    # block's exit halves the scaler's own scale in place. The fused optimizers that read the
    # model's grads divide out the outer block's scale, not the scale after the inner block.
    def pair():
        models = [net(seed=1), net(seed=2)]
        optimizers = [make_optimizer(m.parameters()) for m in models]
        return amp.initialize(models, optimizers, opt_level="O2", verbosity=0)

    models, optimizers = pair()
    expected_models, expected_optimizers = pair()
    with amp.scale_loss(loss_of(expected_models[0](batch(0))), expected_optimizers[0]) as loss:
        loss.backward()
    expected_optimizers[0].step()
    with amp.scale_loss(loss_of(models[0](batch(0))), optimizers[0]) as outer:
        with amp.scale_loss(loss_of(models[1](batch(1))), optimizers[1]) as inner:
            inner.backward()
            poison_grad(models[1].fc1.weight)
        assert amp.loss_scale(0, optimizers[0]) == 2.0**15
        outer.backward()
    optimizers[0].step()
    assert_identical(snapshot(models[0], optimizers[0]), snapshot(expected_models[0], expected_optimizers[0]))
