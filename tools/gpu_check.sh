#!/usr/bin/env bash
# Proves amp's CUDA path in one call on a bare CUDA machine (PyTorch with CUDA, nvcc):
# builds amp_C in place for the visible GPU only, runs `python -m amp.check` (the self-test of every
# kernel on the GPU; with two GPUs, each with the other current), the same with the kernels loaded
# eagerly (CUDA_MODULE_LOADING=EAGER), `pytest -m cuda`, benchmarks/unscale.py and benchmarks/train_step.py on the
# GPU, then the CPU suite against the fresh amp_C, and writes the logs and summary.md (met / not
# met / not run per figure) into OUT_DIR.
#
#   bash tools/gpu_check.sh OUT_DIR
#
# Every phase is time-boxed and a failed phase does not stop the next; the whole run stays
# inside GPU_CHECK_BUDGET_S seconds (default 540) so that it fits a 10-minute device call.
# Test files whose packages are missing are left out, and the summary says so.
# Exit status: 0 every row met, 1 some row not met or not run, 2 misuse, 3 no CUDA GPU.
set -u -o pipefail

if [ $# -ne 1 ]; then
    echo "usage: bash tools/gpu_check.sh OUT_DIR   (logs and summary.md are written there)" >&2
    exit 2
fi
if ! mkdir -p "$1" || ! OUT=$(cd "$1" && pwd); then
    echo "gpu_check: cannot create the output folder $1" >&2
    exit 2
fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2

PYTHON=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}
START=$SECONDS
# The benchmarks import amp and the freshly built amp_C from the root, as pytest does.
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
rm -f "$OUT"/{build,check,check_eager,cuda_tests,cpu_suite,unscale,fused_ops,train_step}.log \
    "$OUT"/{check,check_eager,train_step}.json "$OUT"/summary.md

# A phase that runs out of time gets SIGINT, so that pytest still prints its summary line. A
# shell that starts jobs in the background makes them ignore SIGINT, and Python keeps it
# ignored; `env --default-signal` (coreutils >= 8.31) restores it where it exists.
RESTORE_SIGINT=()
if env --default-signal=INT true 2>/dev/null; then
    RESTORE_SIGINT=(env --default-signal=INT)
fi

# phase NAME LOG LIMIT_S CMD...: runs CMD, output appended to LOG, within LIMIT_S seconds and
# what is left of the budget; LOG's last line records how it ended, for the summary.
phase() {
    local name=$1 log=$2 limit=$3
    shift 3
    local left=$((BUDGET_S - (SECONDS - START)))
    if ((left < 15)); then
        echo "gpu_check: phase $name not run: the ${BUDGET_S} s budget was spent" >>"$log"
        echo "gpu_check: $name not run: the ${BUDGET_S} s budget was spent"
        return
    fi
    ((limit > left)) && limit=$left
    echo "gpu_check: $name (limit $limit s): $*"
    local begin=$SECONDS
    timeout -s INT -k 15 "$limit" "${RESTORE_SIGINT[@]}" "$@" >>"$log" 2>&1
    local code=$?
    echo "gpu_check: phase $name exit $code after $((SECONDS - begin)) s" >>"$log"
    echo "gpu_check: $name exit $code after $((SECONDS - begin)) s"
}

skip() {  # skip NAME LOG REASON
    echo "gpu_check: phase $1 not run: $3" >>"$2"
}

summarize() {
    "$PYTHON" tools/gpu_check_summary.py "$OUT"
}

# Preflight: what this machine is; stop before any build when PyTorch sees no GPU.
if ! timeout 120 "$PYTHON" - >>"$OUT/build.log" 2>&1 <<'EOF'; then
import platform
import sys

import torch

if not torch.cuda.is_available():
    print(f"gpu_check: no CUDA GPU is visible to PyTorch {torch.__version__} "
          f"(built for CUDA {torch.version.cuda}); this check needs a GPU machine with a CUDA "
          f"build of PyTorch and nvcc")
    sys.exit(1)
names = sorted({f"{torch.cuda.get_device_name(i)} (capability "
                f"{'.'.join(map(str, torch.cuda.get_device_capability(i)))})"
                for i in range(torch.cuda.device_count())})
print(f"gpu_check: device {', '.join(names)}; torch {torch.__version__} (CUDA "
      f"{torch.version.cuda}); Python {platform.python_version()}")
EOF
    cat "$OUT/build.log" >&2
    echo "gpu_check: nothing was built or run; see $OUT/summary.md" >&2
    for name in build check check_eager cuda_tests cpu_suite unscale fused_ops train_step; do
        skip "$name" "$OUT/$name.log" "no CUDA GPU (see build.log)"
    done
    summarize >/dev/null
    exit 3
fi
timeout 30 nvidia-smi >>"$OUT/build.log" 2>&1
{ command -v nvcc && nvcc --version; } >>"$OUT/build.log" 2>&1

# Build amp_C in place (the repository root is on pytest's path) for the visible GPUs only.
# A stale amp_C from an earlier build would hide a failed one, so it goes first.
rm -f "$ROOT"/amp_C*.so
ARCHS=$("$PYTHON" -c 'import torch
caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
print(";".join("%d.%d" % cap for cap in sorted(caps)))')
JOBS=$(nproc)
phase build "$OUT/build.log" 300 env AMP_CPP_EXT=1 AMP_CUDA_EXT=1 TORCH_CUDA_ARCH_LIST="$ARCHS" \
    MAX_JOBS="$JOBS" "$PYTHON" setup.py build_ext --inplace
phase amp_C "$OUT/build.log" 60 "$PYTHON" -c "import sys, amp_C; ok = amp_C.cuda_available(); \
print('amp_C', amp_C.__file__, 'cuda_available()', ok); sys.exit(0 if ok else 1)"
# First the check a user runs after building: every kernel against the PyTorch fallback on the GPU
# (and the CPU), amp's training steps, the environment report.
phase check "$OUT/check.log" 120 "$PYTHON" -m amp.check --json "$OUT/check.json"
# torch sets CUDA_MODULE_LOADING=LAZY where it is unset, so the run above loads amp_C's kernels
# lazily (its static CUDA runtime reads the same variable); this one loads them all at once.
phase check_eager "$OUT/check_eager.log" 90 env CUDA_MODULE_LOADING=EAGER "$PYTHON" -m amp.check --quick \
    --only kernels --only gpus --json "$OUT/check_eager.json"

# Test files whose imports are missing here would stop collection: leave them out, say why.
PYTEST=("$PYTHON" -m pytest -q -rA -p no:cacheprovider)
if "$PYTHON" -c "import pytest_timeout" 2>/dev/null; then
    PYTEST+=(--timeout=180)  # a hung test fails alone instead of eating its phase's time
fi
for need in hypothesis:tests/test_multi_tensor_ops.py numpy:tests/test_examples.py \
            sklearn:tests/test_examples.py tqdm:tests/test_examples.py matplotlib:tests/test_examples.py; do
    module=${need%%:*} file=${need#*:}
    if ! "$PYTHON" -c "import $module" 2>/dev/null; then
        PYTEST+=(--ignore="$file")
        for log in cuda_tests cpu_suite; do
            echo "gpu_check: not run: $file ($module is not installed)" >>"$OUT/$log.log"
        done
    fi
done

phase cuda_tests "$OUT/cuda_tests.log" 120 "${PYTEST[@]}" -m cuda
phase unscale "$OUT/unscale.log" 90 "$PYTHON" benchmarks/unscale.py --device cuda
phase fused_ops "$OUT/fused_ops.log" 120 "$PYTHON" benchmarks/fused_ops.py --device cuda --reps 10 \
    --fallback-reps 2
phase train_step "$OUT/train_step.log" 150 "$PYTHON" benchmarks/train_step.py --device cuda \
    --size large --rounds 3 --json "$OUT/train_step.json"
phase cpu_suite "$OUT/cpu_suite.log" "$BUDGET_S" "${PYTEST[@]}" -m "not cuda"

summarize
