"""Each amp.initialize call keeps its own options and loss scalers (its context)."""
import threading

import pytest
import torch

import amp
from amp._amp_state import _amp_state
from amp_common import assert_identical, batch, initialized, loss_of, net, sgd, train_step

LATER_CALLS = {
    "disabled": dict(enabled=False),
    "O0": dict(opt_level="O0"),
    "O1": dict(opt_level="O1"),
    "O3": dict(opt_level="O3"),
    "O5": dict(opt_level="O5"),
}


def _run(model, optimizer, steps, first=0):
    for step in range(first, first + steps):
        train_step(model, optimizer, step, inject=(step == 2))


@pytest.mark.parametrize("later", list(LATER_CALLS))
def test_a_later_initialize_on_other_objects_does_not_change_an_earlier_run(later):
    reference_model, reference_opt = initialized("O2")
    _run(reference_model, reference_opt, 5)
    expected = [p.detach().clone() for p in amp.master_params(reference_opt)]
    expected_scale = _amp_state.loss_scalers[0].loss_scale()

    model, optimizer = initialized("O2")
    scaler = _amp_state.loss_scalers[0]
    _run(model, optimizer, 2)
    other = net(seed=3)
    amp.initialize(other, sgd(other.parameters()), verbosity=0, **LATER_CALLS[later])
    _run(model, optimizer, 3, first=2)

    assert_identical([p.detach() for p in amp.master_params(optimizer)], expected)
    assert scaler.loss_scale() == expected_scale == 2.0**15
    assert int(amp.skipped_steps(optimizer)) == 1


def test_a_disabled_run_passes_its_loss_through_even_after_a_later_enabled_run():
    model = net()
    optimizer = sgd(model.parameters())
    amp.initialize(model, optimizer, enabled=False)
    initialized("O2")
    loss = loss_of(model(batch(0)))
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        assert scaled_loss is loss


def test_optimizers_of_two_initialize_calls_in_one_scale_loss_are_rejected():
    model_a, optimizer_a = initialized("O2")
    model_b, optimizer_b = initialized("O2", seed=1)
    loss = loss_of(model_a(batch(0))) + loss_of(model_b(batch(0)))
    with pytest.raises(ValueError, match="different amp.initialize calls"):
        with amp.scale_loss(loss, [optimizer_a, optimizer_b]):
            pass


def test_the_global_view_shows_the_latest_call():
    model, first = initialized("O2")
    first_scalers = _amp_state.loss_scalers
    initialized("O1", seed=1)
    assert _amp_state.opt_properties.opt_level == "O1"
    assert _amp_state.loss_scalers is not first_scalers
    # The first run still scales with its own dynamic scaler and keeps its fp16 model.
    with amp.scale_loss(loss_of(model(batch(0))), first) as scaled_loss:
        assert scaled_loss.item() / loss_of(model(batch(0))).item() == 2.0**16
        scaled_loss.backward()
    assert model.fc1.weight.dtype == torch.float16


def test_two_threads_with_two_models_each_do_not_share_a_scaler():
    results, errors = {}, []
    start = threading.Barrier(2)

    def worker(name, inject):
        try:
            models = [net(seed=1), net(seed=2)]
            optimizer = sgd([p for m in models for p in m.parameters()])
            models, optimizer = amp.initialize(models, optimizer, opt_level="O2", verbosity=0)
            start.wait()
            for step in range(6):
                loss = sum(loss_of(m(batch(step))) for m in models)
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scale = scaled_loss.item() / loss.item()
                    scaled_loss.backward()
                    if inject:
                        with torch.no_grad():
                            models[0].fc1.weight.grad.view(-1)[0] = float("inf")
                optimizer.step()
                optimizer.zero_grad()
            results[name] = (scale, int(amp.skipped_steps(optimizer)))
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=("overflowing", True)),
               threading.Thread(target=worker, args=("clean", False))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    # The scale used by the last step: 2**16 halved once per earlier overflow of the same run.
    assert results["clean"] == (2.0**16, 0)
    assert results["overflowing"] == (2.0**11, 6)
