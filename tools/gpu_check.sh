#!/usr/bin/env bash
# The one command for a machine with a GPU: from a bare checkout, with the torch that is there
# and nothing installed, in stages of their own time budget (about 9 minutes in all):
#   1. build   deformconv in place, for the visible GPU's architecture only, on every core;
#              beside it, the originals' CUDA ops where originals/src holds their sources
#              (tools/originals.py: copied there from clones, never committed);
#   2. tests   every CUDA test (pytest -m cuda): the CUDA ops against the CPU ones in four dtypes,
#              DCNv3/DCNv4 included, gradcheck, a side stream, a training step in a CUDA
#              graph, torch.compile, autocast, deterministic algorithms, 2^31 elements,
#              im2col_step;
#   3. sanitizer  compute-sanitizer memcheck and racecheck over tools/gpu_kernels_once.py;
#   4. benchmark  python -m deformconv benchmark --device cuda in float32 (TF32 off), float16
#              and bfloat16, on its training batches (GPU_SHAPES) with DCNv3/DCNv4 against
#              the memory roofline and the originals that built; a ResNet-50 training step with DCN v2 (batch 32,
#              bf16 autocast) against torchvision's op and the plain ResNet-50; and four shapes
#              in float32 under deterministic mode (the gathered input gradients);
#   5. ncu     Nsight Compute's achieved DRAM bandwidth and SM throughput of the main kernels,
#              their executed instructions and issue statistics (tools/gpu_profile_once.py),
#              clocks left as they are, into ncu.json.
# Everything it writes goes into OUTDIR, at most 9 files: log.txt (every stage's output),
# summary.json (each stage's status and wall time, the GPU, torch, CUDA), benchmark-*.json, ncu.json
# and one PNG. It always ends with a line "gpu_check: ..." that sums the stages up, and exits 0 only
# if every stage passed.
# Without a GPU it says so and exits 0, having measured nothing; with --rehearse it runs every
# stage it can without one, to try the script itself there: the same build (for compute
# capability 9.0, with nvcc), the CUDA tests (which skip), and a CPU benchmark of two shapes,
# each with four times the budget (compute-sanitizer and ncu need the GPU).
#   bash tools/gpu_check.sh [--rehearse] [OUTDIR, default gpu-check]
set -uo pipefail
rehearse=0
if [ "${1:-}" = "--rehearse" ]; then rehearse=1; shift; fi
python=${PYTHON:-python3}
has_gpu=$("$python" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
if [ "$has_gpu" != 1 ] && [ "$rehearse" = 0 ]; then
  echo "gpu_check: no CUDA device visible: nothing measured (--rehearse tries the stages)"
  exit 0
fi
out=$(mkdir -p "${1:-gpu-check}" && cd "${1:-gpu-check}" && pwd)
cd "$(dirname "$0")/.."
# tools/*.py import deformconv from the checkout, which Python does not put on sys.path itself.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
log="$out/log.txt"
: > "$log"

start=$(date +%s)
declare -A status seconds
stages=(build tests sanitizer benchmark ncu)
for stage in "${stages[@]}"; do status[$stage]="not run"; seconds[$stage]=0; done

summarise() {
  local line="" stage
  for stage in "${stages[@]}"; do
    line+="$stage ${status[$stage]} (${seconds[$stage]} s); "
  done
  STATUS_JSON=$(for stage in "${stages[@]}"; do
    printf '%s\t%s\t%s\n' "$stage" "${status[$stage]}" "${seconds[$stage]}"; done) \
  "$python" - "$out/summary.json" "$rehearse" <<'PY' >> "$log" 2>&1
import json, os, sys
import torch
stages = {}
for row in os.environ["STATUS_JSON"].splitlines():
    name, state, seconds = row.split("\t")
    stages[name] = {"status": state, "seconds": int(seconds)}
summary = {"stages": stages, "rehearsal": sys.argv[2] == "1", "torch": torch.__version__,
           "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32,
                    "cudnn": torch.backends.cudnn.allow_tf32}}
with open(sys.argv[1], "w") as f:
    json.dump(summary, f, indent=1)
PY
  echo "gpu_check: ${line}total $(( $(date +%s) - start )) s; results in $out"
}
trap summarise EXIT

# run_stage NAME BUDGET_SECONDS COMMAND...: the command under `timeout`, its output into the
# log, its status and wall time recorded.
run_stage() {
  local name=$1 budget=$2 stage_start rc
  shift 2
  stage_start=$(date +%s)
  echo "=== $name (budget $budget s): $*" | tee -a "$log"
  timeout --kill-after=10 "$budget" "$@" >> "$log" 2>&1
  rc=$?
  seconds[$name]=$(( $(date +%s) - stage_start ))
  case $rc in
    0) status[$name]=passed ;;
    124|137) status[$name]="timed out" ;;
    *) status[$name]="failed (exit $rc)" ;;
  esac
  echo "=== $name: ${status[$name]} in ${seconds[$name]} s" | tee -a "$log"
  return $rc
}

build() {
  local arch=9.0  # a rehearsal builds for the Hopper GPUs the check is meant for
  if [ "$has_gpu" = 1 ]; then
    arch=$("$python" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
  fi
  # pyproject.toml's metadata (a PEP 639 licence) needs setuptools 77, which build isolation
  # would fetch: here nothing can be fetched.
  "$python" -c 'import setuptools, sys
major = int(setuptools.__version__.split(".")[0])
sys.exit(0 if major >= 77 else f"setuptools {setuptools.__version__} is too old: 77 or newer builds deformconv")'
  # The originals compile in processes of their own, beside deformconv; one that does not build
  # is named in originals/build/status.json, and the benchmark leaves it out.
  local originals_pid="" originals_log
  originals_log=$(mktemp)
  if [ -d originals/src ]; then
    rm -rf originals/build
    "$python" tools/originals.py build --arch "$arch" > "$originals_log" 2>&1 &
    originals_pid=$!
  fi
  DEFORMCONV_WITH_CUDA=1 TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=$(nproc) \
    "$python" setup.py build_ext --inplace
  "$python" -m deformconv info
  if [ -n "$originals_pid" ]; then
    wait "$originals_pid" || echo "tools/originals.py build failed (exit $?)"
    tail -n 3 "$originals_log"
  fi
  rm -f "$originals_log"
}

gpu_tests() {
  "$python" -m pytest -q -p no:cacheprovider -m cuda -rs tests
}

# memcheck fails on any error. racecheck also reports hazards inside cuBLAS's own GEMM kernels
# (nvjet_*, seen on an H200), which are not deformconv's to judge: the stage fails on a hazard
# in a deformconv kernel, or if racecheck did not run to its summary.
sanitizer() {
  if [ "$has_gpu" != 1 ]; then
    echo "no GPU: compute-sanitizer not run"
    return 0
  fi
  compute-sanitizer --tool memcheck --error-exitcode 1 "$python" tools/gpu_kernels_once.py \
    || return 1
  local report rc=0 ours
  report=$(mktemp)
  compute-sanitizer --tool racecheck "$python" tools/gpu_kernels_once.py > "$report" 2>&1 || rc=$?
  cat "$report"
  grep -q "RACECHECK SUMMARY" "$report" || rc=1
  ours=$(grep "Race reported" "$report" \
    | grep -cE "dcnv3_|ms_deform_attn_|im2col_kernel|column_gradients_kernel" \
    || true)
  rm -f "$report"
  echo "racecheck: $ours hazards in deformconv's kernels"
  [ "$rc" = 0 ] && [ "$ours" = 0 ]
}

benchmark() {
  if [ "$has_gpu" != 1 ]; then
    "$python" -m deformconv benchmark --shapes c3 fit-stage4 --repeats 1 --warmup 0 \
      --output "$out/benchmark-cpu.json" --plot "$out/benchmark.png"
    "$python" -m deformconv benchmark-training --device cpu --batch 2 --size 64 \
      --autocast none --repeats 1 --warmup 0 --output "$out/benchmark-training.json"
    return
  fi
  "$python" -m deformconv benchmark-training --device cuda \
    --output "$out/benchmark-training.json" || return 1
  local dtype plot originals=()
  [ -f originals/build/status.json ] && originals=(--originals originals/build)
  for dtype in float32 float16 bfloat16; do
    plot=""
    [ "$dtype" = float32 ] && plot="$out/benchmark.png"
    "$python" -m deformconv benchmark --device cuda --dtype "$dtype" \
      ${originals[@]+"${originals[@]}"} \
      --output "$out/benchmark-$dtype.json" --plot "$plot" || return 1
  done
  # The backwards' gathered input gradients (Note [Gathered input gradients]), against the
  # atomic path of benchmark-float32.json.
  "$python" -m deformconv benchmark --device cuda --deterministic --repeats 3 \
    --shapes c3-batch8 batch32 fit-stage2-batch64 detr-encoder \
    --output "$out/benchmark-float32-deterministic.json" --plot "" || return 1
}

# ncu's sections for the main kernels, one NVTX range per call (tools/gpu_profile_once.py), summed
# per kernel and call into ncu.json (tools/ncu_summary.py); the full CSV goes into the log.
profile() {
  if [ "$has_gpu" != 1 ]; then
    echo "no GPU: ncu not run"
    return 0
  fi
  local report rc=0
  report=$(mktemp)
  ncu --clock-control none --nvtx \
    --kernel-name regex:"dcnv3|ms_deform_attn|im2col|column_gradients" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats --section InstructionStats --section SchedulerStats \
    --section WarpStateStats --csv --print-units base \
    "$python" tools/gpu_profile_once.py > "$report" || rc=$?
  cat "$report"
  "$python" tools/ncu_summary.py "$report" "$out/ncu.json" || rc=1
  rm -f "$report"
  return $rc
}

export -f build gpu_tests sanitizer benchmark profile
export python rehearse has_gpu out
# So that what Python prints reaches the log as it is printed.
export PYTHONUNBUFFERED=1

# A rehearsal runs on a machine of a few cores, not the GPU machine's 16: four times the time.
scale=$(( rehearse && ! has_gpu ? 4 : 1 ))
run_stage build $(( 240 * scale )) bash -ec build || exit 1
run_stage tests $(( 60 * scale )) bash -ec gpu_tests
run_stage sanitizer $(( 60 * scale )) bash -ec sanitizer
run_stage benchmark $(( 150 * scale )) bash -ec benchmark
run_stage ncu $(( 60 * scale )) bash -ec profile
for stage in "${stages[@]}"; do
  [ "${status[$stage]}" = passed ] || exit 1
done
exit 0
