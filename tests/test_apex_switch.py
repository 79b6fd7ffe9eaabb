"""``python -m amp.apex enable | disable | status``, and the Apex-era modules the switch serves.

The subprocess tests (marked slow) use a throwaway venv for the user's environment. It sees this
interpreter's packages (torch, pytest) through a ``.pth`` of its own that adds our site
directories, as ``--system-site-packages`` would add the base interpreter's: so it works whether
the suite runs in a venv or under a system Python. The module fixture flips the switch there and
runs every probe once, each as a fresh process of that venv; each test then checks one behaviour.
The in-process tests call the command's functions on temporary directories.
"""
import base64
import contextlib
import hashlib
import io
import json
import os
import site
import subprocess
import sys
import threading
import venv
from pathlib import Path

import pytest
import torch

import amp
import amp.apex
from amp import _apex_finder
from amp.apex import APEX_ERA_MODULES, PTH_NAME, disable, enable, main, status
from test_distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
BUILT_AMP_C = _apex_finder.PathFinder.find_spec("amp_C") is not None

# The public names of the modules of Apex e13873de (the last Apex with amp) that the switch serves:
# its module-level definitions and what its __init__ files re-export (`git show
# e13873de:apex/parallel/distributed.py` ...), and the underscored ones Apex-era code reads
# (apex.amp._amp_state, ...). Left out: Apex's optimizers that amp does not offer (FusedNovoGrad,
# FusedAdagrad, FusedMixedPrecisionLamb), and apex's own `transformer` and logging
# handler for apex.transformer.
APEX_NAMES = {
    "apex": ["amp", "fp16_utils", "normalization", "optimizers", "parallel", "deprecated_warning",
             "DeprecatedFeatureWarning", "check_cudnn_version_and_warn"],
    "apex.amp": ["init", "half_function", "float_function", "promote_function", "register_half_function",
                 "register_float_function", "register_promote_function", "scale_loss", "disable_casts",
                 "initialize", "state_dict", "load_state_dict", "master_params", "_amp_state",
                 # the submodules Apex's package imported, attributes of it
                 "amp", "compat", "frontend", "handle", "lists", "opt", "rnn_compat", "scaler", "utils",
                 "wrap", "_initialize", "_process_optimizer"],
    "apex.amp.__version__": ["VERSION", "__version__"],
    "apex.amp._amp_state": ["AmpState", "_amp_state", "warn_or_err", "maybe_print", "master_params"],
    "apex.amp._initialize": ["to_type", "applier", "check_models", "check_params_fp32", "check_optimizers",
                             "O2StateDictHook", "_initialize"],
    "apex.amp._process_optimizer": [
        "AmpOptimizerState", "lazy_init_with_master_weights", "post_backward_models_are_masters",
        "prepare_backward_with_master_weights", "post_backward_with_master_weights",
        "lazy_init_no_master_weights", "prepare_backward_no_master_weights", "post_backward_no_master_weights",
        "prepare_backward_with_master_weights_FusedSGD", "post_backward_with_master_weights_FusedSGD",
        "prepare_backward_no_master_weights_FusedSGD", "post_backward_no_master_weights_FusedSGD",
        "_amp_lazy_init", "_process_optimizer", "_master_params_to_model_params"],
    "apex.amp.amp": ["init", "half_function", "float_function", "promote_function", "register_half_function",
                     "register_float_function", "register_promote_function", "AmpHandle", "NoOpHandle",
                     "initialize", "state_dict", "load_state_dict", "Properties", "O0", "O1", "O2", "O3",
                     "opt_levels", "compat", "rnn_compat", "utils", "wrap", "functional_overrides",
                     "torch_overrides", "tensor_overrides", "_amp_state"],
    "apex.amp.compat": ["variable_is_tensor", "tensor_is_variable", "tensor_is_float_tensor", "is_tensor_like",
                        "is_floating_point", "scalar_python_val", "filter_attrs"],
    "apex.amp.frontend": ["Properties", "O0", "O1", "O2", "O3", "opt_levels", "initialize", "state_dict",
                          "load_state_dict"],
    "apex.amp.handle": ["scale_loss", "disable_casts", "AmpHandle", "NoOpHandle"],
    "apex.amp.lists": [],
    "apex.amp.lists.functional_overrides": ["MODULE", "FP16_FUNCS", "FP32_FUNCS", "BANNED_FUNCS"],
    "apex.amp.lists.tensor_overrides": ["MODULE", "FP16_FUNCS", "FP32_FUNCS", "CASTS", "SEQUENCE_CASTS"],
    "apex.amp.lists.torch_overrides": ["MODULE", "FP16_FUNCS", "FP32_FUNCS", "CASTS", "SEQUENCE_CASTS"],
    "apex.amp.opt": ["OptimWrapper"],
    "apex.amp.rnn_compat": ["RNN_NAMES", "VariableFunctionsShim", "has_old_rnns", "whitelist_rnn_cells"],
    "apex.amp.scaler": ["scale_check_overflow_python", "axpby_check_overflow_python", "LossScaler"],
    "apex.amp.utils": ["is_cuda_enabled", "get_cuda_version", "is_fp_tensor", "is_nested", "should_cache",
                       "collect_fp_tensor_types", "type_string", "maybe_half", "maybe_float", "casted_args",
                       "cached_cast", "verbosify", "as_inplace", "has_func", "get_func", "set_func",
                       "set_func_save", "synthesize_flattened_rnn_weights",
                       "new_synthesize_flattened_rnn_weights"],
    "apex.amp.wrap": ["make_cast_wrapper", "cached_cast", "make_promote_wrapper", "promote", "sequence_promote",
                      "promote_match_arg0", "err_if_any_half", "err_if_arg0_half", "rnn_cast", "new_rnn_cast",
                      "disable_casts"],
    "apex.normalization": ["FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm"],
    "apex.normalization.fused_layer_norm": [
        "FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm", "fused_layer_norm",
        "fused_layer_norm_affine", "mixed_dtype_fused_layer_norm_affine", "fused_rms_norm",
        "fused_rms_norm_affine", "mixed_dtype_fused_rms_norm_affine", "manual_rms_norm",
        "FusedLayerNormFunction", "FusedLayerNormAffineFunction", "FusedLayerNormAffineMixedDtypesFunction",
        "FusedRMSNormFunction", "FusedRMSNormAffineFunction", "FusedRMSNormAffineMixedDtypesFunction"],
    "apex.fp16_utils": ["BN_convert_float", "network_to_half", "prep_param_lists",
                        "model_grads_to_master_grads", "master_params_to_model_params", "tofp16",
                        "to_python_float", "clip_grad_norm", "convert_module", "convert_network",
                        "FP16Model", "FP16_Optimizer", "LossScaler", "DynamicLossScaler",
                        "fp16util", "fp16_optimizer", "loss_scaler"],
    "apex.fp16_utils.fp16_optimizer": ["FP16_Optimizer", "model_grads_to_master_grads",
                                       "master_params_to_model_params", "clip_grad_norm"],
    "apex.fp16_utils.fp16util": ["tofp16", "BN_convert_float", "network_to_half", "convert_module",
                                 "convert_network", "FP16Model", "backwards_debug_hook",
                                 "prep_param_lists", "model_grads_to_master_grads",
                                 "master_params_to_model_params", "to_python_float", "TORCH_MAJOR",
                                 "TORCH_MINOR", "clip_grad_norm"],
    "apex.fp16_utils.loss_scaler": ["to_python_float", "LossScaler", "DynamicLossScaler"],
    "apex.parallel": ["ReduceOp", "DistributedDataParallel", "Reducer", "SyncBatchNorm",
                      "convert_syncbn_model", "create_syncbn_process_group"],
    "apex.parallel.LARC": ["LARC"],
    "apex.parallel.distributed": ["imported_flatten_impl", "import_flatten_impl", "flatten",
                                  "unflatten", "apply_flat_dist_call", "split_half_float_double",
                                  "split_by_type", "flat_dist_call", "extract_tensors", "Reducer",
                                  "DistributedDataParallel"],
    "apex.parallel.sync_batchnorm": ["SyncBatchNorm"],
    "apex.parallel.optimized_sync_batchnorm": ["SyncBatchNorm"],
    "apex.parallel.multiproc": [],
    "apex.multi_tensor_apply": ["MultiTensorApply", "multi_tensor_applier"],
    "apex.multi_tensor_apply.multi_tensor_apply": ["MultiTensorApply"],
    "apex.optimizers": ["FusedSGD", "FusedAdam", "FusedLAMB"],
    "apex.optimizers.fused_sgd": ["FusedSGD"],
    "apex.optimizers.fused_adam": ["FusedAdam"],
    "apex.optimizers.fused_lamb": ["FusedLAMB"],
    "amp_C": ["multi_tensor_scale", "multi_tensor_l2norm", "multi_tensor_axpby", "multi_tensor_sgd",
              "multi_tensor_adam", "multi_tensor_l2norm_mp", "multi_tensor_l2norm_scale",
              "multi_tensor_unscale_l2norm", "update_scale_hysteresis", "multi_tensor_lamb",
              "multi_tensor_lamb_stage1_cuda", "multi_tensor_lamb_stage2_cuda"],
    "apex_C": ["flatten", "unflatten"],
}
# What a current NVIDIA Apex (its head: no amp, fp16_utils or parallel) leaves to us.
OURS_BESIDE_APEX_HEAD = ["apex.fp16_utils", "apex.fp16_utils.fp16_optimizer", "apex.fp16_utils.fp16util",
                         "apex.fp16_utils.loss_scaler", "apex.parallel", "apex.parallel.LARC",
                         "apex.parallel.distributed", "apex.parallel.sync_batchnorm",
                         "apex.parallel.optimized_sync_batchnorm", "apex.parallel.multiproc"]

IMPORTS = r'''
import importlib, json, sys
out = {}
for name, expected in json.loads(sys.argv[1]).items():
    try:
        module = importlib.import_module(name)
    except Exception as error:
        out[name] = dict(error=f"{type(error).__name__}: {error}")
    else:
        out[name] = dict(module=module.__name__, file=getattr(module, "__file__", None),
                         missing=[n for n in expected if not hasattr(module, n)])
print(json.dumps(out))
'''

PROBE = r'''
import importlib, importlib.metadata, importlib.util, json, sys
out = {"spec": importlib.util.find_spec("apex") is not None}
try:
    out["version"] = importlib.metadata.version("apex")
except importlib.metadata.PackageNotFoundError:
    out["version"] = None
# What pip reads: every distribution of each sys.path entry, none asked for by name.
out["listed"] = sorted({d.metadata["Name"] for p in sys.path for d in importlib.metadata.distributions(path=[p])}
                       & {"apex"})
out["probes_imported"] = sorted({"torch", "amp"} & set(sys.modules))
try:
    import apex
except ImportError:
    out["import_apex"] = False
else:
    out["import_apex"] = True
    import amp, fp16_utils
    out["apex_file"] = apex.__file__
    # As Apex's old __init__ allowed (without NVIDIA Apex: ours is the apex package).
    out["attribute_access"] = getattr(apex, "fp16_utils", None) is fp16_utils and getattr(apex, "amp", None) is amp
    import apex.amp._amp_state, apex.amp.handle, apex.amp.frontend
    from apex import amp as apex_amp
    from apex.amp import _amp_state, scale_loss
    from apex.fp16_utils import FP16_Optimizer
    from apex.parallel.LARC import LARC
    import apex.parallel
    out["same"] = dict(
        amp=apex_amp is amp and apex.amp is amp and sys.modules["apex.amp"] is amp,
        state=apex.amp._amp_state is amp._amp_state and _amp_state is amp._amp_state,
        submodules=apex.amp.handle is sys.modules["amp.handle"] and apex.amp.frontend is sys.modules["amp.frontend"],
        fp16_utils=apex.fp16_utils is fp16_utils and FP16_Optimizer is fp16_utils.FP16_Optimizer,
        scale_loss=scale_loss is amp.scale_loss, amp_spec=amp.__spec__.name == "amp",
        larc=LARC is amp.parallel.LARC and apex.parallel.LARC is sys.modules["apex.parallel.LARC"],
        parallel=apex.parallel.DistributedDataParallel is amp.parallel.DistributedDataParallel)
    star = {}
    exec("from apex.fp16_utils import *", star)
    out["star"] = sorted(star)
    out["amp_C_available"] = amp.multi_tensor_apply.MultiTensorApply.available
    try:
        import apex.optimizers
        out["optimizers"] = apex.optimizers.__file__
    except ImportError:
        out["optimizers"] = None
print(json.dumps(out))
'''

# Import lines of public Apex-era code (GitHub), and what Apex's own tests at e13873de imported.
REAL_IMPORT_LINES = [
    "from apex.amp.rnn_compat import has_old_rnns", "from apex.amp.frontend import O3",
    "from apex.amp._amp_state import _amp_state", "from apex.amp.frontend import state_dict",
    "from apex.amp.compat import filter_attrs", "from apex.amp.handle import scale_loss",
    "from apex.amp import scale_loss", "import apex.amp as amp; from apex.amp import half_function",
    "from apex.amp import __version__", "from apex.amp import _amp_state", "from apex.amp import float_function",
    "from apex.amp import amp, scale_loss", "from apex.amp import initialize",
    "from apex.amp.lists import functional_overrides, tensor_overrides, torch_overrides",
    "from apex.amp.utils import is_fp_tensor",
    "from apex import amp as apex_amp; apex_amp._process_optimizer.post_backward_models_are_masters",
    "from apex.amp._amp_state import maybe_print, warn_or_err, master_params",
    "from apex.amp.handle import AmpHandle, NoOpHandle, disable_casts",
    "from apex.amp.frontend import Properties, O0, O1, O2, O3, opt_levels",
    "from apex.amp.scaler import LossScaler", "from apex.amp.opt import OptimWrapper",
    "from apex.amp.wrap import make_cast_wrapper", "from apex.parallel.LARC import LARC",
    "from apex.multi_tensor_apply import multi_tensor_applier",
    "from apex.fp16_utils import FP16_Optimizer", "from apex.amp import _amp_state; _amp_state.loss_scalers",
]
REAL_IMPORTS = r'''
import json, sys
out = {}
for line in json.loads(sys.argv[1]):
    try:
        exec(line, {})
    except Exception as error:
        out[line] = f"{type(error).__name__}: {error}"
    else:
        out[line] = "ok"
print(json.dumps(out))
'''

# Apex-era models import amp and Apex's layers in one try block, with a fallback for both.
TRY_BLOCK = r'''
import json
try:
    from apex import amp
    from apex.normalization import FusedLayerNorm
    from apex.optimizers import FusedAdam
except ImportError as error:
    print(json.dumps(dict(error=str(error))))
else:
    print(json.dumps(dict(amp=amp.__name__, FusedLayerNorm=getattr(FusedLayerNorm, "WHO", FusedLayerNorm.__module__),
                          FusedAdam=getattr(FusedAdam, "WHO", FusedAdam.__module__))))
'''

# NVIDIA's BERT pretraining (DeepLearningExamples, Apex era) with allreduce_post_accumulation, and
# its GLUE/SQuAD gradient clipper, on the CPU: each result against plain torch.
BERT_CALLS = r'''
import json, torch
import amp_C, apex_C
from apex.multi_tensor_apply import multi_tensor_applier
torch.manual_seed(0)
grads = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2)]
flat_raw = torch.empty(sum(g.numel() for g in grads))
views = apex_C.unflatten(flat_raw, grads)
overflow_buf = torch.zeros(1, dtype=torch.int)
amp_C.multi_tensor_scale(65536, overflow_buf, [grads, views], 1024.0 / 8)
flat = apex_C.flatten(grads)
norm, per_tensor = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow_buf, [grads], True)
out = dict(
    views_are_flat_raw=all(v.data_ptr() == flat_raw[o:].data_ptr() for v, o in
                           zip(views, [0, 15, 22])),
    scaled=torch.equal(flat_raw, torch.cat([(g * 128.0).reshape(-1) for g in grads])),
    flatten=torch.equal(flat, torch.cat([g.reshape(-1) for g in grads])),
    norm=torch.allclose(norm, torch.linalg.vector_norm(flat).reshape(1), rtol=1e-6),
    per_tensor=torch.allclose(per_tensor, torch.stack([torch.linalg.vector_norm(g) for g in grads])),
    finite_flag=overflow_buf.item())
grads[1][3] = float("inf")
amp_C.multi_tensor_scale(65536, overflow_buf, [grads, views], 1.0)
out["inf_flag"] = overflow_buf.item()
out["build_info"] = hasattr(amp_C, "build_info")  # amp's build's own attributes, where built
lamb_stage1 = amp_C.multi_tensor_lamb_stage1_cuda  # bound at import by BERT's optimization.py
try:
    lamb_stage1(2048, overflow_buf, [grads])
except NotImplementedError as error:
    out["not_offered"] = str(error)
print(json.dumps(out))
'''

# A current NVIDIA Apex as far as imports go: its head's layout, no extensions.
APEX_HEAD_LAYOUT = {
    "apex/__init__.py": "from . import optimizers, normalization\nWHO = 'nvidia apex'\n",
    "apex/_autocast_utils.py": "",
    "apex/optimizers/__init__.py": "from .fused_adam import FusedAdam\nfrom .fused_lamb import FusedLAMB\n",
    "apex/optimizers/fused_adam.py": "class FusedAdam:\n    WHO = 'nvidia apex'\n",
    "apex/optimizers/fused_lamb.py": "class FusedLAMB:\n    WHO = 'nvidia apex'\n",
    "apex/optimizers/fused_sgd.py": "class FusedSGD:\n    WHO = 'nvidia apex'\n",
    "apex/normalization/__init__.py": "from .fused_layer_norm import FusedLayerNorm\n",
    "apex/normalization/fused_layer_norm.py": "class FusedLayerNorm:\n    WHO = 'nvidia apex'\n",
    "apex/multi_tensor_apply/__init__.py": ("from .multi_tensor_apply import MultiTensorApply\n"
                                            "multi_tensor_applier = MultiTensorApply(2048 * 32)\n"),
    "apex/multi_tensor_apply/multi_tensor_apply.py": ("class MultiTensorApply:\n    available = False\n\n"
                                                      "    def __init__(self, chunk_size):\n"
                                                      "        self.chunk_size = chunk_size\n"),
    "apex/contrib/__init__.py": "",
    "apex/distributed_testing/__init__.py": "",
    "apex/fused_dense/__init__.py": "",
    "apex/mlp/__init__.py": "",
    "apex-0.1.dev0.dist-info/METADATA": "Metadata-Version: 2.1\nName: apex\nVersion: 0.1.dev0\n",
}
# An Apex from before May 2025, which still shipped amp and parallel.
OLD_APEX_LAYOUT = {
    "apex/__init__.py": "",
    "apex/amp/__init__.py": "WHO = 'nvidia apex amp'\n",
    "apex/parallel/__init__.py": "WHO = 'nvidia apex parallel'\n",
}

START_UP = "import sys, json; print(json.dumps(sorted(sys.modules)))"

MULTIPROC_SCRIPT = r'''
import sys, time
rank, world = sys.argv[sys.argv.index("--rank") + 1], sys.argv[sys.argv.index("--world-size") + 1]
print(f"rank {rank} of {world}: {sys.argv[1]}", flush=True)
if sys.argv[1] == "fail":
    if rank == "1":
        sys.exit(3)
    time.sleep(300)  # rank 0 waits for a peer that is gone: the launcher must stop it
'''


def write_tree(root, files):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def our_site_dirs():
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if os.path.isdir(d)]


def make_venv(path):
    """A venv for the user's environment: its own site-packages (where ``enable`` writes), then
    this interpreter's site directories, added as site directories (their .pth files run too)."""
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(path)
    python = path / "bin" / "python"
    python = python if python.exists() else path / "Scripts" / "python.exe"
    site_dir = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip())
    (site_dir / "_test_outer_site.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in our_site_dirs()) + "\n")
    return python, site_dir


def start(python, *args, pythonpath=(), cwd=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, pythonpath), str(ROOT)]),
               OMP_NUM_THREADS="1")
    env.pop("PYTHONNOUSERSITE", None)
    return subprocess.Popen([str(python), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=str(cwd or ROOT.parent))


def finish(process, check=True):
    stdout, stderr = process.communicate(timeout=300)
    assert not check or process.returncode == 0, stderr
    return stdout, stderr


def run(python, *args, pythonpath=()):
    return finish(start(python, *args, pythonpath=pythonpath))[0]


def start_probe(python, *flags, pythonpath=()):
    return start(python, *flags, "-c", PROBE, pythonpath=pythonpath)


def start_imports(python, names, pythonpath=()):
    return start(python, "-c", IMPORTS, json.dumps({n: APEX_NAMES.get(n, []) for n in names}),
                 pythonpath=pythonpath)


def json_result(process):
    stdout, stderr = finish(process)
    return dict(json.loads(stdout.splitlines()[-1]), stderr=stderr)


def command(*args):
    """``python -m amp.apex ...`` in this process: enable, disable and status only touch files."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        main(list(args))
    return output.getvalue()


def digest(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def fake_editable_install(site_dir, name="amp_under_test"):
    """The ``.dist-info`` that ``pip install -e`` of this tree would leave (a RECORD, a METADATA,
    and the ``direct_url.json`` that names the tree)."""
    info = site_dir / f"{name}-0.1.0.dist-info"
    files = {"METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n", "INSTALLER": "pip\n",
             "direct_url.json": json.dumps({"url": ROOT.as_uri(), "dir_info": {"editable": True}})}
    write_tree(info, files)
    (info / "RECORD").write_text("".join(f"{info.name}/{f},,\n" for f in [*files, "RECORD"]))
    return info / "RECORD"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("apex_switch")
    python, site_dir = make_venv(base / "venv")
    apex_head = write_tree(base / "nvidia", APEX_HEAD_LAYOUT)
    apex_old = write_tree(base / "old_nvidia", OLD_APEX_LAYOUT)
    (base / "multiproc_worker.py").write_text(MULTIPROC_SCRIPT)
    for run_dir in ("multiproc", "multiproc_fail"):  # each writes its own GPU_1.log
        (base / run_dir).mkdir()
    before = digest(apex_head)
    out = dict(site_dir=site_dir, apex_head=apex_head, site_before=sorted(p.name for p in site_dir.iterdir()))
    out["torch_file"] = run(python, "-c", "import torch; print(torch.__file__)").strip()
    out["start_up_off"] = json.loads(run(python, "-c", START_UP))
    out["off"] = json_result(start_probe(python))
    out["status_off"] = command("status", "--site", str(site_dir))
    out["enable"] = command("enable", "--site", str(site_dir))
    out["site_on"] = sorted(p.name for p in site_dir.iterdir())
    # Independent new processes of the enabled venv, run side by side (most import torch).
    worker = str(base / "multiproc_worker.py")
    started = dict(
        a=start_probe(python), b=start_probe(python, pythonpath=[apex_head]),
        imports_a=start_imports(python, [*APEX_NAMES, *APEX_ERA_MODULES]),
        imports_b=start_imports(python, [*APEX_ERA_MODULES, "apex.optimizers.something_old"],
                                pythonpath=[apex_head]),
        bert=start(python, "-c", BERT_CALLS),
        real_imports_a=start(python, "-c", REAL_IMPORTS, json.dumps(REAL_IMPORT_LINES)),
        real_imports_b=start(python, "-c", REAL_IMPORTS, json.dumps(REAL_IMPORT_LINES), pythonpath=[apex_head]),
        try_block_a=start(python, "-c", TRY_BLOCK),
        try_block_b=start(python, "-c", TRY_BLOCK, pythonpath=[apex_head]),
        status_on=start(python, "-m", "amp.apex", "status"),
        status_b=start(python, "-m", "amp.apex", "status", pythonpath=[apex_head]),
        old_apex=start(python, "-c", "import apex.amp, apex.parallel, apex.fp16_utils, fp16_utils; "
                       "print(apex.amp.WHO, apex.parallel.WHO, apex.fp16_utils is fp16_utils)",
                       pythonpath=[apex_old]),
        no_site=start_probe(python, "-S"),
        start_up=start(python, "-c", START_UP),
        multiproc=start(python, "-m", "apex.parallel.multiproc", worker, "hello", "--world-size", "2",
                        cwd=base / "multiproc"),
        multiproc_fail=start(python, "-m", "apex.parallel.multiproc", worker, "fail", "--world-size", "2",
                             cwd=base / "multiproc_fail"),
        example=start(python, "-m", "torch.distributed.run", "--nproc_per_node=2",
                      "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                      str(ROOT / "examples" / "apex_style" / "train_apex.py"), "--smoke",
                      "--device", "cpu"))
    for name, process in started.items():
        if name.startswith("multiproc"):
            stdout, stderr = finish(process, check=False)
            out[name] = dict(code=process.returncode, stdout=stdout, stderr=stderr)
        elif name in ("status_on", "status_b", "example", "old_apex"):
            out[name] = finish(process)[0]
        elif name == "start_up":
            out[name] = json.loads(finish(process)[0])
        else:
            out[name] = json_result(process)
    out["gpu_1_log"] = (base / "multiproc" / "GPU_1.log").read_text()
    out["head_untouched"] = digest(apex_head) == before
    pth = site_dir / PTH_NAME
    line = pth.read_text()
    pth.write_text(line.replace(str(ROOT / "amp" / "_apex_finder.py"), str(base / "gone" / "_apex_finder.py")))
    out["amp_gone"] = json_result(start_probe(python))
    out["disable"] = command("disable", "--site", str(site_dir))
    out["site_off"] = sorted(p.name for p in site_dir.iterdir())
    out["after_disable"] = json_result(start_probe(python))
    # amp installed (editable) in the venv: enable there, then pip uninstall it.
    record = fake_editable_install(site_dir)
    out["enable_installed"] = run(python, "-m", "amp.apex", "enable")
    out["recorded"] = PTH_NAME in record.read_text()
    out["pip_uninstall"] = run(python, "-m", "pip", "uninstall", "-y", "amp_under_test")
    out["site_after_uninstall"] = sorted(p.name for p in site_dir.iterdir())
    return out


@pytest.mark.slow
def test_the_test_venv_sees_this_environments_packages_not_the_base_interpreters(world):
    assert Path(world["torch_file"]) == Path(torch.__file__)


@pytest.mark.slow
def test_enable_writes_one_file_of_ours_into_site_packages_and_disable_removes_it(world):
    assert world["site_on"] == sorted(world["site_before"] + [PTH_NAME])
    assert world["site_off"] == world["site_before"]
    assert "enabled" in world["enable"] and "disabled" in world["disable"]


@pytest.mark.slow
def test_status_says_whether_enabled_which_world_and_whether_this_process_has_the_finder(world):
    assert world["status_off"].startswith("apex drop-in: disabled")
    assert "finder is not active" in world["status_off"]
    assert world["status_on"].startswith("apex drop-in: enabled")
    assert "NVIDIA Apex: not installed" in world["status_on"] and "finder is active" in world["status_on"]
    assert f"NVIDIA Apex: {world['apex_head'] / 'apex' / '__init__.py'}" in world["status_b"]


def module_table(status_text):
    """``status``'s module lines: {module path: what answers it}."""
    rows = [line.split(None, 1) for line in status_text.splitlines() if line.startswith("  ")]
    return {row[0]: row[1] for row in rows if row[0] in APEX_ERA_MODULES}


@pytest.mark.slow
@pytest.mark.parametrize("status_of, name, where", [
    ("status_on", "apex", "amp: amp._apex.apex"), ("status_b", "apex", "NVIDIA Apex: "),
    ("status_on", "apex.parallel.LARC", "amp: amp._apex.apex.parallel.LARC"),
    ("status_b", "apex.parallel.LARC", "amp: amp._apex.apex.parallel.LARC"),
    ("status_on", "apex.optimizers", "amp: amp.optimizers"), ("status_b", "apex.optimizers", "NVIDIA Apex: "),
    ("status_on", "apex.transformer", "missing"), ("status_off", "apex.fp16_utils", "amp: fp16_utils")])
def test_status_lists_every_apex_era_module_path_and_what_answers_it(world, status_of, name, where):
    table = module_table(world[status_of])
    assert sorted(table) == sorted(APEX_ERA_MODULES)
    assert table[name].startswith(where), table[name]


@pytest.mark.slow
def test_disabled_nothing_answers_to_apex(world):
    for state in ("off", "after_disable"):
        assert world[state]["spec"] is False and world[state]["version"] is None
        assert world[state]["import_apex"] is False


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(APEX_NAMES))
def test_without_nvidia_apex_each_apex_era_module_path_imports_with_apexs_public_names(world, name):
    assert world["imports_a"][name].get("missing") == [], world["imports_a"][name]


@pytest.mark.slow
@pytest.mark.parametrize("line", REAL_IMPORT_LINES)
@pytest.mark.parametrize("apex_world", ["a", "b"], ids=["without_apex", "beside_apex_head"])
def test_import_lines_of_apex_era_code_work_in_both_worlds(world, apex_world, line):
    assert world[f"real_imports_{apex_world}"][line] == "ok"


@pytest.mark.slow
def test_a_try_block_of_amp_and_apexs_layers_takes_ours_without_apex_and_apexs_beside_it(world):
    assert world["try_block_a"] == dict(amp="amp", FusedLayerNorm="amp.normalization.fused_layer_norm",
                                        FusedAdam="amp.optimizers.fused_adam", stderr="")
    assert world["try_block_b"] == dict(amp="amp", FusedLayerNorm="nvidia apex", FusedAdam="nvidia apex",
                                        stderr="")


@pytest.mark.slow
def test_without_nvidia_apex_the_apex_modules_are_amps_own_module_objects(world):
    result = world["a"]
    assert result["import_apex"] and all(result["same"].values()), result["same"]
    assert result["attribute_access"] is True


@pytest.mark.slow
def test_without_nvidia_apex_apex_file_points_at_the_mirror_package(world):
    assert Path(world["a"]["apex_file"]) == ROOT / "amp" / "_apex" / "apex" / "__init__.py"


@pytest.mark.slow
def test_from_apex_fp16_utils_import_star_binds_apexs_names(world):
    assert set(APEX_NAMES["apex.fp16_utils"]) <= set(world["a"]["star"])


@pytest.mark.slow
@pytest.mark.parametrize("check", ["views_are_flat_raw", "scaled", "flatten", "norm", "per_tensor"])
def test_without_nvidia_apex_bert_pretraining_amp_C_and_apex_C_calls_match_plain_torch(world, check):
    assert world["bert"][check] is True


@pytest.mark.slow
def test_amp_C_scale_flags_a_non_finite_gradient_as_apexs_did(world):
    assert world["bert"]["finite_flag"] == 0 and world["bert"]["inf_flag"] == 1


@pytest.mark.slow
def test_amp_C_kernel_amp_lacks_is_an_attribute_that_raises_with_what_to_use(world):
    assert "multi_tensor_lamb_stage1_cuda" in world["bert"]["not_offered"]
    assert "Use an optimizer instead of the raw kernel" in world["bert"]["not_offered"]


@pytest.mark.slow
def test_amp_still_tells_a_built_amp_C_from_the_switchs_stand_in(world):
    assert world["a"]["amp_C_available"] is BUILT_AMP_C
    assert world["bert"]["build_info"] is BUILT_AMP_C
    assert world["imports_a"]["amp_C"]["module"] == "amp._apex.amp_C"


@pytest.mark.slow
def test_enabled_find_spec_and_metadata_by_name_report_apex_but_listings_do_not(world):
    assert world["a"]["spec"] is True and world["a"]["version"] == amp.__version__
    assert world["a"]["listed"] == []  # pip freeze / install / uninstall never see the stand-in


@pytest.mark.slow
def test_probing_for_apex_imports_neither_amp_nor_torch(world):
    assert world["a"]["probes_imported"] == [] and world["b"]["probes_imported"] == []


def expected_beside_apex_head(name):
    """Who answers ``name`` beside Apex's head: "apex" (it ships it), "amp" or None (nobody)."""
    def shipped(path):
        return path == "apex" or f"{path}/__init__.py" in APEX_HEAD_LAYOUT or f"{path}.py" in APEX_HEAD_LAYOUT

    if shipped(name.replace(".", "/")):
        return "apex"
    if shipped("/".join(name.split(".")[:2])):
        return None  # a module a package of Apex's lacks: its own error
    if name in OURS_BESIDE_APEX_HEAD or name.startswith("apex.amp"):
        return "amp"
    # Beside NVIDIA Apex the switch serves no amp_C: the import finds what is installed.
    return "amp build" if name == "amp_C" and BUILT_AMP_C else None


@pytest.mark.slow
@pytest.mark.parametrize("name", APEX_ERA_MODULES)
def test_beside_apex_head_each_module_it_lacks_is_ours_and_each_it_ships_its_own(world, name):
    result, expected = world["imports_b"][name], expected_beside_apex_head(name)
    if expected is None:
        assert "ModuleNotFoundError" in result.get("error", ""), result
    else:
        assert "error" not in result, result
        assert result["file"].startswith(str(world["apex_head"] if expected == "apex" else ROOT)), result
        assert expected != "amp" or result["missing"] == [], result


@pytest.mark.slow
def test_beside_apex_head_a_module_its_package_lacks_stays_apexs_own_error(world):
    assert world["imports_b"]["apex.optimizers.something_old"]["error"] == (
        "ModuleNotFoundError: No module named 'apex.optimizers.something_old'")


@pytest.mark.slow
def test_beside_apex_head_amp_and_fp16_utils_are_ours_and_its_metadata_its_own(world):
    result = world["b"]
    assert all(result["same"].values()), result["same"]
    assert result["version"] == "0.1.dev0"
    assert result["optimizers"] == str(world["apex_head"] / "apex" / "optimizers" / "__init__.py")


@pytest.mark.slow
def test_beside_nvidia_apex_its_files_are_never_written(world):
    assert world["head_untouched"]


@pytest.mark.slow
def test_an_apex_that_still_ships_amp_and_parallel_is_never_shadowed(world):
    assert world["old_apex"].split() == ["nvidia", "apex", "amp", "nvidia", "apex", "parallel", "True"]


@pytest.mark.slow
def test_python_dash_S_reads_no_pth_so_the_switch_does_not_reach_it(world):
    assert world["no_site"]["import_apex"] is False


@pytest.mark.slow
def test_a_pth_left_behind_by_a_removed_amp_fails_soft_and_silently(world):
    assert world["amp_gone"]["import_apex"] is False and world["amp_gone"]["stderr"] == ""


@pytest.mark.slow
def test_start_up_with_the_switch_imports_only_the_finder_and_importlib_machinery(world):
    # importlib.metadata and importlib.abc (email, zipfile, ...) would cost every process ~10 ms.
    added = set(world["start_up"]) - set(world["start_up_off"])
    assert "_amp_apex_finder" in added
    assert added <= {"_amp_apex_finder", "importlib", "importlib._bootstrap", "importlib._bootstrap_external",
                     "importlib.machinery", "warnings"}, added


@pytest.mark.slow
def test_multiproc_launches_one_process_per_rank_with_apexs_arguments(world):
    assert world["multiproc"]["code"] == 0, world["multiproc"]["stderr"]
    assert "rank 0 of 2: hello" in world["multiproc"]["stdout"]
    assert world["gpu_1_log"] == "rank 1 of 2: hello\n"


@pytest.mark.slow
def test_multiproc_stops_every_rank_when_one_fails_and_exits_with_its_status(world):
    assert world["multiproc_fail"]["code"] == 3
    assert "rank 1 exited with status 3" in world["multiproc_fail"]["stderr"]


@pytest.mark.slow
def test_pip_uninstall_of_an_installed_amp_removes_the_switch(world):
    assert "listed in amp's install record" in world["enable_installed"] and world["recorded"]
    assert PTH_NAME not in world["site_after_uninstall"], world["pip_uninstall"]


@pytest.mark.slow
def test_apex_style_example_runs_unmodified_under_torchrun_through_the_switch_with_ranks_identical(world):
    assert "parameters identical on all 2 ranks: True" in world["example"]


# In-process: the command's functions on temporary directories.

def test_concurrent_enables_never_share_a_temporary_file(tmp_path, monkeypatch):
    monkeypatch.setattr(amp.apex, "_own_record", lambda: None)  # a source tree: no install record
    (tmp_path / f"{PTH_NAME}.tmp").mkdir()  # a name a fixed-name writer would need
    errors = []

    def enable_repeatedly():
        for _ in range(10):
            try:
                enable(tmp_path)
            except BaseException as error:  # noqa: B902 (SystemExit included)
                errors.append(error)

    threads = [threading.Thread(target=enable_repeatedly) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [PTH_NAME, f"{PTH_NAME}.tmp"]


def test_enable_where_the_pth_name_is_a_directory_explains_and_leaves_nothing_behind(tmp_path):
    (tmp_path / PTH_NAME).mkdir()
    with pytest.raises(SystemExit, match="is a directory, not amp's file") as raised:
        enable(tmp_path)
    assert raised.value.code != 0
    assert [p.name for p in tmp_path.iterdir()] == [PTH_NAME]


def test_enable_on_a_filesystem_that_refuses_the_write_explains_and_leaves_nothing_behind(tmp_path, monkeypatch):
    def read_only(*args):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(amp.apex.os, "replace", read_only)
    with pytest.raises(SystemExit, match="Read-only file system; nothing was changed"):
        enable(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_disable_without_permission_explains_instead_of_a_traceback(tmp_path, monkeypatch):
    enable(tmp_path)

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "unlink", denied)
    with pytest.raises(SystemExit, match="no permission to write to"):
        disable(tmp_path)


def test_enable_user_creates_a_missing_user_site_as_pip_install_user_does(tmp_path, monkeypatch):
    user_site = tmp_path / "home" / ".local" / "lib" / "site-packages"
    monkeypatch.setattr(site, "ENABLE_USER_SITE", True)
    monkeypatch.setattr(site, "getusersitepackages", lambda: str(user_site))
    assert "enabled" in command("enable", "--user")
    assert (user_site / PTH_NAME).is_file()


def test_enable_user_in_a_venv_that_reads_no_user_site_is_refused(monkeypatch):
    monkeypatch.setattr(site, "ENABLE_USER_SITE", False)
    monkeypatch.setattr(sys, "flags", type("Flags", (), dict(no_site=0, no_user_site=0))())
    with pytest.raises(SystemExit, match="does not read the user site"):
        command("enable", "--user")


def test_status_of_a_disabled_environment_says_the_switch_is_not_in_force(tmp_path):
    lines = status(tmp_path)
    assert lines[0].startswith("apex drop-in: disabled") and "no apex module resolves to amp" in lines[0]
    assert any("as they would resolve with `python -m amp.apex enable`" in line for line in lines)


def test_enable_lists_the_pth_in_amps_install_record_and_disable_takes_it_out(tmp_path, monkeypatch):
    installed, site_dir = tmp_path / "installed", tmp_path / "site"
    site_dir.mkdir()
    record = fake_editable_install(installed)
    monkeypatch.syspath_prepend(str(installed))
    pth, said = enable(site_dir)
    rows = [line.split(",") for line in record.read_text().splitlines()]
    data = pth.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    assert "listed in amp's install record" in said
    assert [row for row in rows if row[0].endswith(PTH_NAME)] == [
        [os.path.relpath(pth, installed), f"sha256={digest}", str(len(data))]]
    assert amp.apex._recorded(record, pth)
    disable(site_dir)
    assert PTH_NAME not in record.read_text()


def test_finder_answers_metadata_only_to_a_probe_that_asks_for_apex_by_name():
    import importlib.metadata

    finder = _apex_finder.ApexAliasFinder()
    context = importlib.metadata.DistributionFinder.Context
    assert list(finder.find_distributions(context())) == []
    assert list(finder.find_distributions(context(name="torch"))) == []
    (dist,) = finder.find_distributions(context(name="apex"))
    assert dist.version == amp.__version__


@pytest.fixture
def fake_mirror(tmp_path, monkeypatch):
    """A mirror with two ``apex.amp`` modules amp lacks (one named like amp's ``__version__``),
    served by a finder of this process; every trace is removed afterwards."""
    write_tree(tmp_path, {"fake_mirror/__init__.py": "", "fake_mirror/apex/__init__.py": "",
                          "fake_mirror/apex/amp/__init__.py": "",
                          "fake_mirror/apex/amp/__version__.py": "VERSION = (0, 1, 0)\n",
                          "fake_mirror/apex/amp/compat.py": "WHO = 'mirror'\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", [_apex_finder.ApexAliasFinder("fake_mirror"), *sys.meta_path])
    yield
    for name in [n for n in sys.modules if n.split(".")[0] in ("apex", "fake_mirror")]:
        del sys.modules[name]
    if "compat" in vars(amp):
        del amp.compat


def test_finder_serves_apex_amp_modules_amp_lacks_from_the_mirror_keeping_amps_attributes(fake_mirror):
    version = amp.__version__
    import apex.amp.__version__
    import apex.amp.compat

    assert apex.amp is amp and apex.amp.compat.WHO == "mirror"
    assert sys.modules["apex.amp.__version__"].VERSION == (0, 1, 0)
    assert amp.__version__ == version


def test_apex_C_unflatten_refuses_a_flat_tensor_that_does_not_hold_exactly_the_tensors():
    from amp._apex import apex_C

    tensors = [torch.zeros(2, 3), torch.zeros(4)]
    assert [v.shape for v in apex_C.unflatten(torch.arange(10.0), tensors)] == [(2, 3), (4,)]
    with pytest.raises(ValueError, match="1-D tensor of the 10 elements"):
        apex_C.unflatten(torch.arange(11.0), tensors)


def test_amp_C_l2norm_scale_gives_the_inputs_norms_and_scaled_copies():
    from amp._apex import amp_C

    torch.manual_seed(0)
    ins = [torch.randn(5).half(), torch.randn(3, 2).half()]
    outs = [torch.empty(5), torch.empty(3, 2)]
    flag = torch.zeros(1, dtype=torch.int)
    norm, per_tensor = amp_C.multi_tensor_l2norm_scale(2048, flag, [ins, outs], 0.25, True)
    flat = torch.cat([t.float().reshape(-1) for t in ins])
    assert torch.allclose(norm, torch.linalg.vector_norm(flat).reshape(1))
    assert torch.allclose(per_tensor, torch.stack([torch.linalg.vector_norm(t.float()) for t in ins]))
    assert all(torch.equal(o, i.float() * 0.25) for i, o in zip(ins, outs)) and flag.item() == 0
    ins[1][2, 1] = float("inf")
    amp_C.multi_tensor_l2norm_scale(2048, flag, [ins, outs], 0.25)
    assert flag.item() == 1
    with pytest.raises(AttributeError, match="stand-in"):
        amp_C.not_an_op


def test_multiproc_without_a_gpu_or_world_size_says_what_to_pass(monkeypatch):
    from amp._apex.apex.parallel import multiproc

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit, match="pass --world-size N.*torchrun --nproc_per_node=N train.py --lr 1"):
        multiproc.main(["train.py", "--lr", "1"])
    with pytest.raises(SystemExit, match="--world-size needs a number"):
        multiproc.main(["train.py", "--world-size", "two"])
