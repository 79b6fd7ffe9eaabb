"""Fixtures every test file gets without importing them: amp's state reset after each test, and
the casting engine's device / patch-type / handle fixtures."""
import os

# Before torch loads OpenMP: threads that wait for work sleep instead of spinning. The tests run
# many tiny parallel regions; on a machine shared with other work (a CI runner, two test runs at
# once) spinning threads fight for the cores and some tests run ten times slower. Results are
# unchanged, and the kernels still run on every thread. A value you set yourself wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

import amp.casting  # noqa: E402
from amp._amp_state import _amp_state  # noqa: E402
from amp.casting.registry import consume_registry  # noqa: E402
from casting_common import DEVICES  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True)
def fresh_amp():
    """Each test starts and ends without amp state, O1 patches or loss scalers left behind."""
    yield
    amp.deactivate()
    _amp_state.opt_properties = None
    _amp_state.context = None
    _amp_state.loss_scalers = []
    _amp_state.runs = []
    _amp_state.verbosity = 1
    _amp_state.hard_override = False
    _amp_state.allow_incoming_model_not_fp32 = False
    _amp_state.overflow_process_group = None


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(params=[torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def low(request):
    """The casting engine's patch type: fp16 (O1) or bf16 (O4)."""
    return request.param


@pytest.fixture
def fresh_state():
    """Leave no handle, patch or pending registration behind."""
    yield
    amp.deactivate()
    consume_registry()


@pytest.fixture
def handle(low, fresh_state):
    return amp.casting.init(patch_type=low)
