"""Libraries that still call ``apex.amp``, run unmodified through the switch alone, on the CPU.

Each client runs in a fresh process that executes the switch's ``.pth`` line first (what ``python
-m amp.apex enable`` makes every process of the environment run) and then imports only the
library and ``apex``: mmengine's ``ApexOptimWrapper``, timm's ``ApexScaler``, DeepSpeed's
``"amp"`` config block, and the shape of NVIDIA's BERT pretraining loop and GNMT's scale read
(DeepLearningExamples, scripts not packaged). Each trains the tests' ``Net`` on the same batches
as a plain fp32 run computed first, in the same process, before anything is initialized. A
library that is not installed is skipped: they are not amp's dependencies; ``.ci/run`` installs the
pinned versions that ``docs/apex-dropin.md`` lists, so CI runs every client.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from amp.apex import _FINDER_FILE, _pth_line
from amp_common import TOLERANCES
from test_distributed import free_port

ROOT = Path(__file__).resolve().parents[1]

# The plain fp32 run every client is compared with: same model, batches and optimizer.
FP32_RUN = r'''
import json, sys
import torch
from amp_common import adam, batch, loss_of, net, sgd

def fp32_losses(steps, make_optimizer, clip=None):
    model = net()
    optimizer = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        loss = loss_of(model(batch(step)))
        losses.append(loss.item())
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return losses

STEPS = 8
'''

MMENGINE = r'''
import mmengine, mmengine.model  # a Runner has imported mmengine.model, which optim_context reads
from mmengine.optim import ApexOptimWrapper
''' + FP32_RUN + r'''
out = dict(version=mmengine.__version__, fp32=fp32_losses(STEPS, sgd))
SAVE = 4

def run(wrapper, model, steps, losses):
    for step in steps:
        with wrapper.optim_context(model):  # amp.initialize, the first time
            loss = loss_of(model(batch(step)))
        losses.append(loss.item())
        wrapper.update_params(loss)

model = net()
wrapper = ApexOptimWrapper(optimizer=sgd(model.parameters()), opt_level="O2", verbosity=0)
out["losses"] = []
run(wrapper, model, range(STEPS), out["losses"])
out["stash"] = hasattr(wrapper.optimizer, "_amp_stash")
expected = [p.detach().clone() for group in wrapper.optimizer.param_groups for p in group["params"]]
# mmengine's resume: model and wrapper load the checkpoint before optim_context initializes.
model = net()
wrapper = ApexOptimWrapper(optimizer=sgd(model.parameters()), opt_level="O2", verbosity=0)
run(wrapper, model, range(SAVE), [])
saved = dict(model=model.state_dict(), optimizer=wrapper.state_dict())
out["saved_amp_keys"] = sorted(saved["optimizer"]["apex_amp"])
model = net(seed=1)
model.load_state_dict(saved["model"])
wrapper = ApexOptimWrapper(optimizer=sgd(model.parameters()), opt_level="O2", verbosity=0)
wrapper.load_state_dict(saved["optimizer"])
run(wrapper, model, range(SAVE, STEPS), [])
resumed = [p.detach() for group in wrapper.optimizer.param_groups for p in group["params"]]
out["resume_bit_exact"] = len(resumed) == len(expected) and all(map(torch.equal, resumed, expected))
print(json.dumps(out))
'''

# timm/__init__ imports timm.layers, which needs torchvision, and PyPI's torchvision wheel does not
# load beside a CPU build of torch: ApexScaler's own module is loaded from timm's installed files
# without running those two package __init__s; its imports (apex.amp, .clip_grad) run as written.
TIMM = r'''
import importlib.metadata, importlib.util, pathlib, sys, types
root = pathlib.Path(importlib.util.find_spec("timm").origin).parent
for name, path in (("timm", root), ("timm.utils", root / "utils")):
    package = sys.modules[name] = types.ModuleType(name)
    package.__path__ = [str(path)]
from timm.utils.cuda import ApexScaler, has_apex
''' + FP32_RUN + r'''
from apex import amp
CLIP = 0.05
out = dict(version=importlib.metadata.version("timm"), has_apex=has_apex, fp32=fp32_losses(STEPS, adam, CLIP))
model = net()
model, optimizer = amp.initialize(model, adam(model.parameters()), opt_level="O2", verbosity=0)
scaler, out["losses"] = ApexScaler(), []
for step in range(STEPS):
    loss = loss_of(model(batch(step)))
    out["losses"].append(loss.item())
    scaler(loss, optimizer, clip_grad=CLIP)  # clips amp.master_params(optimizer), then steps
    optimizer.zero_grad()
out["saved_amp_keys"] = sorted(scaler.state_dict())
print(json.dumps(out))
'''

DEEPSPEED = r'''
import os, sys
os.environ.update(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
import deepspeed
from deepspeed.accelerator import get_accelerator
''' + FP32_RUN + r'''
opt_level = sys.argv[1]
out = dict(version=deepspeed.__version__, fp32=fp32_losses(STEPS, sgd))
if opt_level == "O2":
    # O2 leaves the model's grads fp16; DeepSpeed's CPU accelerator reduces fp16 grads only on
    # CPUs with native fp16 (engine.split_half_float_double_sparse asserts it): answer as one does.
    get_accelerator().is_fp16_supported = lambda: True
model = net()
config = {"train_micro_batch_size_per_gpu": 16, "amp": {"enabled": True, "opt_level": opt_level, "verbosity": 0}}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=sgd(model.parameters()), config=config)
out["losses"] = []
for step in range(STEPS):  # DeepSpeed calls amp.initialize, scale_loss and step itself
    loss = loss_of(engine(batch(step)))
    out["losses"].append(loss.item())
    engine.backward(loss)
    engine.step()
from apex import amp
out["amp_enabled"] = engine.amp_enabled()
out["stash"] = hasattr(engine.optimizer, "_amp_stash")
out["saved_amp_keys"] = sorted(amp.state_dict())
print(json.dumps(out))
'''

# NVIDIA's BERT pretraining (run_pretraining.py) at O2 with FusedLAMB: its resume through Apex's lazy init and a
# copy of the saved masters; GNMT's trainer reads the scale through _amp_state.loss_scalers.
BERT_GNMT = r'''
import copy
from apex import amp
from apex.amp import _amp_state
from apex.optimizers import FusedLAMB
''' + FP32_RUN + r'''
SAVE = 4
def make(params):  # BERT pretraining's optimizer and its defaults but the learning rate
    return FusedLAMB(params, lr=0.01, weight_decay=0.01, max_grad_norm=1.0)

def train(model, optimizer, steps, losses):
    for step in steps:
        loss = loss_of(model(batch(step)))
        losses.append(loss.item())
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()

def initialized(seed=0):
    model = net(seed)
    return amp.initialize(model, make(model.parameters()), opt_level="O2", verbosity=0)

out = dict(version="DeepLearningExamples BERT/GNMT loop shape", fp32=fp32_losses(STEPS, make), losses=[])
model, optimizer = initialized()
train(model, optimizer, range(STEPS), out["losses"])
expected = [p.detach().clone() for p in amp.master_params(optimizer)]
out["gnmt_scale_read"] = _amp_state.loss_scalers[0].loss_scale() == amp.state_dict()["loss_scaler0"]["loss_scale"]
model, optimizer = initialized()
train(model, optimizer, range(SAVE), [])
checkpoint = copy.deepcopy(dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
                                master_params=list(amp.master_params(optimizer))))
model, optimizer = initialized(seed=1)
model.load_state_dict(checkpoint["model"])
optimizer._lazy_init_maybe_master_weights()
optimizer._amp_stash.lazy_init_called = True
optimizer.load_state_dict(checkpoint["optimizer"])
for param, saved in zip(amp.master_params(optimizer), checkpoint["master_params"]):
    param.data.copy_(saved.data)
train(model, optimizer, range(SAVE, STEPS), [])
out["resume_bit_exact"] = all(map(torch.equal, amp.master_params(optimizer), expected))
print(json.dumps(out))
'''


def run_client(script, *args, needs=None):
    """``script`` in a fresh process whose first line is the switch's ``.pth`` line."""
    if needs is not None and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} is not installed (an optional client, not a dependency of amp)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
               OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    source = _pth_line(_FINDER_FILE) + script
    process = subprocess.run([sys.executable, "-c", source, *args], env=env, capture_output=True,
                             text=True, timeout=600, cwd=str(ROOT.parent))
    assert process.returncode == 0, process.stderr
    return json.loads(process.stdout.splitlines()[-1])


def assert_tracks_fp32(result):
    assert len(result["losses"]) == len(result["fp32"])
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["fp32"]),
                               **TOLERANCES[torch.float16])


@pytest.mark.slow
def test_mmengine_apex_optim_wrapper_trains_and_resumes_bit_exactly_through_the_switch():
    result = run_client(MMENGINE, needs="mmengine")
    assert_tracks_fp32(result)
    assert result["stash"] and result["saved_amp_keys"] == ["loss_scaler0"]
    assert result["resume_bit_exact"]


@pytest.mark.slow
def test_timm_apex_scaler_clips_the_masters_and_steps_through_the_switch():
    result = run_client(TIMM, needs="timm")
    assert result["has_apex"]
    assert_tracks_fp32(result)
    assert result["saved_amp_keys"] == ["loss_scaler0"]


@pytest.mark.slow
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_deepspeed_amp_config_block_trains_through_the_switch(opt_level):
    result = run_client(DEEPSPEED, opt_level, needs="deepspeed")
    assert result["amp_enabled"] and result["stash"] and result["saved_amp_keys"] == ["loss_scaler0"]
    assert_tracks_fp32(result)


@pytest.mark.slow
def test_bert_pretraining_loop_resumes_bit_exactly_and_gnmt_reads_the_scale_through_the_switch():
    result = run_client(BERT_GNMT)
    assert_tracks_fp32(result)
    assert result["gnmt_scale_read"] and result["resume_bit_exact"]
