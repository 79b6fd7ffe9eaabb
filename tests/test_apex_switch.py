"""``python -m amp.apex enable | disable | status``: Apex-era imports in new processes.

A throwaway venv (``--system-site-packages``, so it reuses this torch) stands for the user's
environment. The module fixture flips the switch there and runs every probe once, as a fresh
process of that venv; each test then checks one behaviour.
"""
import contextlib
import hashlib
import io
import json
import os
import subprocess
import venv
from pathlib import Path

import pytest

import amp
from amp.apex import PTH_NAME, main
from test_distributed import free_port

ROOT = Path(__file__).resolve().parents[1]

PROBE = r'''
import importlib, importlib.metadata, importlib.util, json, sys
out = {"spec": importlib.util.find_spec("apex") is not None}
try:
    out["version"] = importlib.metadata.version("apex")
except importlib.metadata.PackageNotFoundError:
    out["version"] = None
try:
    import apex
except ImportError:
    out["import_apex"] = False
else:
    out["import_apex"] = True
    import amp, fp16_utils
    # As Apex's old __init__ allowed (without NVIDIA Apex: ours is the apex package).
    out["attribute_access"] = getattr(apex, "fp16_utils", None) is fp16_utils and getattr(apex, "amp", None) is amp
    import apex.amp._amp_state, apex.amp.handle, apex.amp.frontend
    from apex import amp as apex_amp
    from apex.amp import _amp_state, scale_loss
    from apex.fp16_utils import FP16_Optimizer, network_to_half
    from apex.multi_tensor_apply import multi_tensor_applier
    out["same"] = dict(
        amp=apex_amp is amp and apex.amp is amp and sys.modules["apex.amp"] is amp,
        state=apex.amp._amp_state is amp._amp_state and _amp_state is amp._amp_state,
        submodules=apex.amp.handle is sys.modules["amp.handle"] and apex.amp.frontend is sys.modules["amp.frontend"],
        fp16_utils=apex.fp16_utils is fp16_utils and FP16_Optimizer is fp16_utils.FP16_Optimizer,
        scale_loss=scale_loss is amp.scale_loss, amp_spec=amp.__spec__.name == "amp")
    out["multi_tensor_apply"] = multi_tensor_applier.__module__
    import apex.parallel
    out["parallel"] = {n: getattr(apex.parallel, n).__module__ for n in
                       ("DistributedDataParallel", "LARC", "SyncBatchNorm", "convert_syncbn_model")
                       if hasattr(apex.parallel, n)}
    try:
        import apex.optimizers
        out["optimizers"] = apex.optimizers.__file__
        out["fused"] = {n: getattr(apex.optimizers, n).__module__ for n in ("FusedSGD", "FusedAdam")
                        if hasattr(apex.optimizers, n)}
    except ImportError:
        out["optimizers"] = None
print(json.dumps(out))
'''


def make_venv(path):
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(path)
    python = path / "bin" / "python"
    return python if python.exists() else path / "Scripts" / "python.exe"


def start(python, *args, pythonpath=()):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, pythonpath), str(ROOT)]),
               OMP_NUM_THREADS="1")
    env.pop("PYTHONNOUSERSITE", None)
    return subprocess.Popen([str(python), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=str(ROOT.parent))


def finish(process):
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    return stdout, stderr


def run(python, *args, pythonpath=()):
    return finish(start(python, *args, pythonpath=pythonpath))[0]


def start_probe(python, *flags, pythonpath=()):
    return start(python, *flags, "-c", PROBE, pythonpath=pythonpath)


def probe_result(process):
    stdout, stderr = finish(process)
    return dict(json.loads(stdout), stderr=stderr)


def probe(python, *flags, pythonpath=()):
    return probe_result(start_probe(python, *flags, pythonpath=pythonpath))


def command(*args):
    """``python -m amp.apex ...`` in this process: enable, disable and status only touch files."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        main(list(args))
    return output.getvalue()


def stand_in_apex(root, ships_amp=False):
    """A current NVIDIA Apex as far as imports and metadata go: no amp, its own optimizers."""
    pkg = root / "apex"
    for sub in ("optimizers", "normalization", "contrib", "parallel", "multi_tensor_apply"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text(f"WHO = 'nvidia apex {sub}'\n")
    (pkg / "multi_tensor_apply" / "__init__.py").write_text("def multi_tensor_applier(*a): pass\n")
    (pkg / "__init__.py").write_text("WHO = 'nvidia apex'\n")
    if ships_amp:
        (pkg / "amp").mkdir()
        (pkg / "amp" / "__init__.py").write_text("WHO = 'nvidia apex amp'\n")
    dist_info = root / "apex-0.1.dev0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: apex\nVersion: 0.1.dev0\n")
    return root


def digest(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("apex_switch")
    python = make_venv(base / "venv")
    site_dir = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip())
    apex_b = stand_in_apex(base / "nvidia")
    apex_old = stand_in_apex(base / "old_nvidia", ships_amp=True)
    before_b = digest(apex_b)
    out = dict(site_dir=site_dir, apex_b=apex_b, site_before=sorted(p.name for p in site_dir.iterdir()))
    out["off"] = probe(python)
    out["status_off"] = command("status", "--site", str(site_dir))
    out["enable"] = command("enable", "--site", str(site_dir))
    out["site_on"] = sorted(p.name for p in site_dir.iterdir())
    # Independent new processes of the enabled venv, run side by side (each imports torch).
    started = dict(a=start_probe(python), b=start_probe(python, pythonpath=[apex_b]),
                   status_on=start(python, "-m", "amp.apex", "status"),
                   status_b=start(python, "-m", "amp.apex", "status", pythonpath=[apex_b]),
                   old_apex=start(python, "-c", "import apex.amp; print(apex.amp.WHO)", pythonpath=[apex_old]),
                   no_site=start_probe(python, "-S"),
                   example=start(python, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                 "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                                 str(ROOT / "examples" / "apex_style" / "train_apex.py"), "--smoke",
                                 "--device", "cpu"))
    for name, process in started.items():
        out[name] = probe_result(process) if name in ("a", "b", "no_site") else finish(process)[0]
    out["b_untouched"] = digest(apex_b) == before_b
    pth = site_dir / PTH_NAME
    line = pth.read_text()
    pth.write_text(line.replace(str(ROOT / "amp" / "_apex_finder.py"), str(base / "gone" / "_apex_finder.py")))
    out["amp_gone"] = probe(python)
    out["disable"] = command("disable", "--site", str(site_dir))
    out["site_off"] = sorted(p.name for p in site_dir.iterdir())
    out["after_disable"] = probe(python)
    return out


def test_enable_writes_one_file_of_ours_into_site_packages_and_disable_removes_it(world):
    assert world["site_on"] == sorted(world["site_before"] + [PTH_NAME])
    assert world["site_off"] == world["site_before"]
    assert "enabled" in world["enable"] and "disabled" in world["disable"]


def test_status_says_whether_enabled_which_world_and_whether_this_process_has_the_finder(world):
    assert world["status_off"].startswith("apex drop-in: disabled")
    assert "finder is not active" in world["status_off"]
    assert world["status_on"].startswith("apex drop-in: enabled")
    assert "NVIDIA Apex: not installed" in world["status_on"] and "finder is active" in world["status_on"]
    world_b = world["status_b"].splitlines()[1]
    assert world_b.startswith(f"NVIDIA Apex: {world['apex_b'] / 'apex' / '__init__.py'}")
    assert "apex.amp -> amp" in world_b and "apex.parallel" not in world_b


def test_disabled_nothing_answers_to_apex(world):
    for state in ("off", "after_disable"):
        assert world[state]["spec"] is False and world[state]["version"] is None
        assert world[state]["import_apex"] is False


def test_enabled_new_process_resolves_every_apex_name_to_the_same_modules(world):
    result = world["a"]
    assert result["import_apex"] and all(result["same"].values()), result["same"]
    assert result["multi_tensor_apply"] == "amp.multi_tensor_apply"
    assert result["parallel"] == dict(DistributedDataParallel="amp.parallel.distributed",
                                      LARC="amp.parallel.larc", SyncBatchNorm="amp.parallel.sync_batchnorm",
                                      convert_syncbn_model="amp.parallel.sync_batchnorm")
    assert result["fused"] == dict(FusedSGD="amp.optimizers.fused_sgd", FusedAdam="amp.optimizers.fused_adam")


def test_without_nvidia_apex_plain_import_apex_reaches_its_modules_as_attributes(world):
    assert world["a"]["attribute_access"] is True


def test_enabled_find_spec_and_metadata_report_apex(world):
    assert world["a"]["spec"] is True
    assert world["a"]["version"] == amp.__version__


def test_with_nvidia_apex_amp_and_fp16_utils_are_ours_and_everything_it_ships_stays_its_own(world):
    result = world["b"]
    assert all(result["same"].values()), result["same"]
    assert result["version"] == "0.1.dev0"
    assert result["multi_tensor_apply"] == "apex.multi_tensor_apply"
    assert result["parallel"] == {}  # the stand-in's apex.parallel, with none of our names
    assert result["optimizers"].endswith(os.path.join("nvidia", "apex", "optimizers", "__init__.py"))


def test_with_nvidia_apex_its_files_are_never_written(world):
    assert world["b_untouched"]


def test_an_apex_that_still_ships_amp_is_never_shadowed(world):
    assert world["old_apex"].strip() == "nvidia apex amp"


def test_python_dash_S_reads_no_pth_so_the_switch_does_not_reach_it(world):
    assert world["no_site"]["import_apex"] is False


def test_a_pth_left_behind_by_an_uninstalled_amp_fails_soft_and_silently(world):
    assert world["amp_gone"]["import_apex"] is False and world["amp_gone"]["stderr"] == ""


def test_apex_style_example_runs_unmodified_under_torchrun_through_the_switch_with_ranks_identical(world):
    assert "parameters identical on all 2 ranks: True" in world["example"]
