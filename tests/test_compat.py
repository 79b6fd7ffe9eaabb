"""amp._compat: each probe finds its torch API here, and a missing one fails clearly."""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from amp import _compat
from amp_common import needs_fused

REPO = Path(__file__).resolve().parents[1]


def test_probes_bind_torch_itself():
    assert _compat.non_finite_check_and_unscale_ is torch._amp_foreach_non_finite_check_and_unscale_
    try:
        torch._foreach_norm([torch.ones(1)], 2, dtype=torch.float32)
    except TypeError:  # torch < 2.4
        assert _compat.foreach_norm is _compat._vector_norms
    else:
        assert _compat.foreach_norm is torch._foreach_norm
    assert _compat.is_compiling is torch.compiler.is_compiling
    assert _compat.eager_under_compile is torch._disable_dynamo
    # torch 2.3 has it too, but its torch.compile cannot trace it.
    if torch.torch_version.TorchVersion(torch.__version__) >= (2, 4):
        assert _compat.any_autocast_enabled is torch._C._is_any_autocast_enabled
    else:
        assert _compat.any_autocast_enabled is _compat._autocast_on_cuda_or_cpu
    assert _compat.rnn_module() is torch.nn.modules.rnn
    if hasattr(torch.nn.Module, "register_state_dict_post_hook"):  # torch >= 2.5
        assert (_compat.register_state_dict_post_hook
                is torch.nn.Module.register_state_dict_post_hook)
        assert (_compat.register_load_state_dict_pre_hook
                is torch.nn.Module.register_load_state_dict_pre_hook)
    else:
        assert (_compat.register_state_dict_post_hook
                is torch.nn.Module._register_state_dict_hook)
        assert (_compat.register_load_state_dict_pre_hook
                is _compat._private_load_state_dict_pre_hook)
    assert _compat.coalesced_sparse_coo_tensor is _compat._sparse_coo_is_coalesced


@needs_fused(torch.optim.Adam)
def test_found_inf_contract():
    param = torch.zeros(1, requires_grad=True)
    assert _compat.optimizer_accepts_found_inf(torch.optim.Adam([param], fused=True))
    assert not _compat.optimizer_accepts_found_inf(torch.optim.Adam([param]))


def test_missing_unscale_kernel_names_it(monkeypatch):
    monkeypatch.delattr(torch, "_amp_foreach_non_finite_check_and_unscale_")
    unscale = _compat._probe_non_finite_check_and_unscale()
    with pytest.raises(RuntimeError, match=r"_amp_foreach_non_finite_check_and_unscale_.*"
                                           + torch.__version__.replace("+", r"\+")):
        unscale([torch.ones(1)], torch.zeros(1), torch.ones(1))


def test_missing_foreach_op_fails_import(monkeypatch):
    monkeypatch.delattr(torch, "_foreach_copy_")
    with pytest.raises(ImportError, match="torch._foreach_copy_"):
        _compat._require_foreach_ops()


def test_missing_rnn_internals_names_them(monkeypatch):
    monkeypatch.delattr(torch.nn.modules.rnn.RNNBase, "check_input")
    rnn_module = _compat._probe_rnn_internals()
    with pytest.raises(RuntimeError, match=r"RNNBase\.check_input.*O2/O3"):
        rnn_module()


@pytest.mark.parametrize("public, private, probe", [
    ("register_state_dict_post_hook", "_register_state_dict_hook",
     _compat._probe_state_dict_post_hook),
    ("register_load_state_dict_pre_hook", "_register_load_state_dict_pre_hook",
     _compat._probe_load_state_dict_pre_hook),
])
def test_missing_state_dict_hook_names_it(monkeypatch, public, private, probe):
    monkeypatch.delattr(torch.nn.Module, public, raising=False)
    monkeypatch.delattr(torch.nn.Module, private)
    with pytest.raises(RuntimeError, match=public):
        probe()(torch.nn.Linear(1, 1), lambda *args: None)


def test_state_dict_hooks_of_torch_before_2_5_are_called_like_the_public_ones(monkeypatch):
    monkeypatch.delattr(torch.nn.Module, "register_state_dict_post_hook", raising=False)
    monkeypatch.delattr(torch.nn.Module, "register_load_state_dict_pre_hook", raising=False)
    seen = []
    module = torch.nn.Linear(1, 1)
    _compat._probe_state_dict_post_hook()(
        module, lambda *args: seen.append(("saved", args[0], sorted(args[1]), args[2])))
    _compat._probe_load_state_dict_pre_hook()(
        module, lambda *args: seen.append(("loading", args[0], sorted(args[1]), args[2])))
    module.load_state_dict(module.state_dict())
    assert seen == [("saved", module, ["bias", "weight"], ""),
                    ("loading", module, ["bias", "weight"], "")]


def test_foreach_norm_without_dtype_falls_back(monkeypatch):
    def no_dtype(tensors, ord=2):
        return [torch.linalg.vector_norm(t, ord) for t in tensors]
    monkeypatch.setattr(torch, "_foreach_norm", no_dtype)
    foreach_norm = _compat._probe_foreach_norm()
    xs = [torch.tensor([3.0, 4.0], dtype=torch.float16)]
    assert foreach_norm is _compat._vector_norms
    assert foreach_norm(xs, 2, dtype=torch.float32)[0].dtype == torch.float32


@needs_fused(torch.optim.Adam)
def test_missing_found_inf_contract_reads_flag_on_host(monkeypatch):
    adam = importlib.import_module("torch.optim.adam")
    monkeypatch.setattr(adam, "adam", lambda params, grads: None)
    accepts = _compat._probe_found_inf_contract()
    param = torch.zeros(1, requires_grad=True)
    assert not accepts(torch.optim.Adam([param], fused=True))


def test_missing_is_compiling_means_not_compiling(monkeypatch):
    monkeypatch.delattr(torch.compiler, "is_compiling")
    assert _compat._probe_is_compiling()() is False


def test_without_disable_dynamo_torch_compile_traces_amp_as_any_code(monkeypatch):
    monkeypatch.delattr(torch, "_disable_dynamo")
    eager_under_compile = _compat._probe_eager_under_compile()

    def fn():
        return 1

    assert eager_under_compile(fn) is fn and eager_under_compile(recursive=False)(fn) is fn


@pytest.mark.filterwarnings("ignore:torch.is_autocast_cpu_enabled:DeprecationWarning")
def test_autocast_is_seen_on_cuda_and_the_cpu_before_torch_asks_every_device(monkeypatch):
    monkeypatch.delattr(torch._C, "_is_any_autocast_enabled", raising=False)
    any_autocast_enabled = _compat._probe_any_autocast_enabled()
    assert any_autocast_enabled() is False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert any_autocast_enabled() is True


def test_a_plain_tensor_is_its_own_local_tensor():
    t = torch.ones(2)
    assert _compat.local_tensor(t) is t
    param = torch.nn.Parameter(t)
    assert _compat.local_tensor(param) is param


def test_sparse_coo_without_is_coalesced_falls_back(monkeypatch):
    real = torch.sparse_coo_tensor

    def no_is_coalesced(indices, values, size, **kwargs):
        if kwargs:
            raise TypeError("sparse_coo_tensor() got an unexpected keyword argument")
        return real(indices, values, size, check_invariants=True)
    monkeypatch.setattr(torch, "sparse_coo_tensor", no_is_coalesced)
    make = _compat._probe_sparse_coo_is_coalesced()
    assert make is _compat._sparse_coo_coalesce
    out = make(torch.tensor([[1, 0]]), torch.tensor([2.0, 3.0]), (2,))
    assert out.is_coalesced() and out.to_dense().tolist() == [3.0, 2.0]



@pytest.mark.slow
def test_importing_amp_warns_about_nothing():
    # The probes run at import: a torch warning from one would greet every user.
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-W", "error", "-c", "import amp"], cwd=REPO, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_importing_amp_draws_no_random_numbers():
    # A script that seeds, builds its model, then imports amp (Lightning imports apex.amp that late)
    # must see the random numbers it would see without amp: the probes run at import.
    script = ("import torch; torch.manual_seed(0); before = torch.get_rng_state(); "
              "import amp, amp.optimizers, amp.parallel, fp16_utils; "
              "assert torch.equal(torch.get_rng_state(), before), 'import amp drew random numbers'")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_importing_amp_and_an_inference_forward_load_no_distributed_tensor_fsdp_or_compiler():
    # They cost half a second (sympy) and a second (torch._dynamo) in every process that imports
    # amp; amp probes DTensor and FSDP2 at first use, and recognises their objects without
    # importing them. (A torch.optim optimizer imports all of them when it is built.)
    script = ("import sys, torch; import amp, amp.optimizers, amp.parallel, fp16_utils; "
              "model = amp.initialize(torch.nn.Linear(2, 2), opt_level='O2', verbosity=0); "
              "model(torch.ones(1, 2)); "
              "print(sorted(name for name in ('sympy', 'torch.distributed.tensor', 'torch.distributed.fsdp', "
              "'torch._dynamo') if name in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
