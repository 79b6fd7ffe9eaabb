"""Several amp runs in one process: each model computes as its own opt level says, inside its
forward, whatever later ``initialize`` calls do; outside every amp model the latest call's
policy applies, with a warning when that changes an earlier run's."""
import copy
import logging
import threading

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import amp
from amp.casting import policy
from amp_common import LEVELS, assert_identical, batch, initialized, snapshot, train_step


def _train(opt_level, other_level=None, steps=3):
    """Run A's steps; with ``other_level``, a run B on another model is initialised after A and
    stepped between A's steps."""
    amp.deactivate()
    model, optimizer = initialized(opt_level)
    if other_level is not None:
        other = initialized(other_level, seed=1)
    losses = []
    for step in range(steps):
        losses.append(train_step(model, optimizer, step).detach())
        if other_level is not None:
            train_step(*other, step)
    return losses, snapshot(model, optimizer)


@pytest.mark.parametrize("first", LEVELS)
def test_a_later_initialize_leaves_an_earlier_run_bit_identical(first):
    alone = _train(first)
    for second in LEVELS:
        assert_identical(_train(first, second), alone, path=f"{first} then {second}")


class _Student(nn.Module):
    """A student whose forward calls a teacher that is not one of its submodules."""

    def __init__(self, teacher):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.teacher = [teacher]

    def forward(self, x):
        return self.linear(x), self.teacher[0](x)


def test_teacher_inside_a_student_forward_computes_at_its_own_level():
    torch.manual_seed(0)
    teacher = nn.Linear(4, 2)
    x = batch(0)
    expected = copy.deepcopy(teacher)(x)  # plain fp32 torch, before any amp call
    teacher = amp.initialize(teacher, opt_level="O0", verbosity=0)
    student = _Student(teacher)
    student, _ = amp.initialize(student, torch.optim.SGD(student.parameters(), lr=0.1),
                                opt_level="O1", verbosity=0)
    out, target = student(x)
    assert out.dtype == torch.float16  # the student's own linear: O1
    assert_identical(target, expected)
    assert_identical(teacher(x), expected)  # outside, called directly


class _Fails(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, fail=False):
        y = self.linear(x)
        if fail:
            raise KeyError("inside forward")
        return y


def _initialized_model(opt_level, module_class=None):
    model = (module_class or _Fails)()
    return amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          opt_level=opt_level, verbosity=0)[0]


def test_policy_is_restored_when_a_forward_raises():
    model = _initialized_model("O1")
    initialized("O2", seed=1)
    outside = policy.current
    with pytest.raises(KeyError):
        model(batch(0), fail=True)
    assert policy.current is outside
    assert F.linear(batch(0), torch.ones(2, 4)).dtype == torch.float32  # O2's rule outside
    assert model(batch(0)).dtype == torch.float16  # O1's rule inside


def test_disable_casts_covers_an_amp_model_forward():
    model = _initialized_model("O1")
    with amp.disable_casts():
        assert model(batch(0)).dtype == torch.float32
    assert model(batch(0)).dtype == torch.float16


@pytest.mark.parametrize("first,second", [("O1", "O4"), ("O4", "O2"), ("O0", "O1")])
def test_changing_the_outside_policy_of_a_live_run_warns(first, second, caplog):
    live = initialized(first)  # noqa: F841  (kept alive: the run is live while its objects are)
    with caplog.at_level(logging.WARNING, logger="amp"):
        initialized(second, seed=1)
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert f"opt_level={first!r}" in record.getMessage()
    assert f"opt_level={second!r}" in record.getMessage()


@pytest.mark.parametrize("first,second", [("O1", "O1"), ("O2", "O3"), ("O0", "O5")])
def test_no_warning_when_the_outside_policy_is_unchanged(first, second, caplog):
    live = initialized(first)  # noqa: F841
    with caplog.at_level(logging.WARNING, logger="amp"):
        initialized(second, seed=1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_no_warning_about_a_run_whose_models_and_optimizers_are_gone(caplog):
    # Its optimizer and amp's controller reference each other, so it lingers until collected.
    initialized("O1")
    with caplog.at_level(logging.WARNING, logger="amp"):
        initialized("O2", seed=1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_copied_model_keeps_its_run_policy():
    model, _ = initialized("O4")
    initialized("O1", seed=1)
    assert copy.deepcopy(model)(batch(0)).dtype == torch.bfloat16


class _Waits(nn.Module):
    """Holds its forward open until ``release`` is set."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.entered, self.release = threading.Event(), threading.Event()

    def forward(self, x):
        self.entered.set()
        self.release.wait(10)
        return self.linear(x)


def _forward_in_thread(model):
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=model(batch(0))))
    thread.start()
    assert model.entered.wait(10)
    return thread, result


def test_a_forward_at_another_level_in_another_thread_raises():
    waits = _initialized_model("O4", _Waits)
    other = _initialized_model("O1")
    thread, result = _forward_in_thread(waits)
    try:
        with pytest.raises(RuntimeError, match="one thread"):
            other(batch(0))
    finally:
        waits.release.set()
        thread.join()
    assert result["out"].dtype == torch.bfloat16
    assert other(batch(0)).dtype == torch.float16


def test_forwards_at_one_level_run_in_several_threads():
    waits = _initialized_model("O1", _Waits)
    other = _initialized_model("O1")
    thread, result = _forward_in_thread(waits)
    try:
        assert other(batch(0)).dtype == torch.float16
    finally:
        waits.release.set()
        thread.join()
    assert result["out"].dtype == torch.float16


def test_disable_casts_blocks_overlapping_in_two_threads_restore_the_casts_once_both_left():
    # Two threads' optimizer.step() run with casts off; the first to leave must neither switch
    # the casts back on under the other nor leave them off after both have left.
    model = _initialized_model("O1")
    x = torch.randn(2, 4)
    a_inside, b_inside, a_left = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def thread_a():
        with amp.disable_casts():
            a_inside.set()
            b_inside.wait()
        a_left.set()

    def thread_b():
        a_inside.wait()
        with amp.disable_casts():
            b_inside.set()
            a_left.wait()
            seen["inside b after a left"] = torch.mm(x, x.t()).dtype

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen["inside b after a left"] == torch.float32
    assert torch.mm(x, x.t()).dtype == torch.float16
    assert model(x).dtype == torch.float16
