#!/usr/bin/env bash
# Issue 11's GPU work, one device-tool call per mode (see benchmarks/NOTES.md, "GPU sessions").
#
#   bash benchmarks/gpu_session.sh [MODE]        # from the repository root, on the device machine
#
# MODE
#   first     the one prepared call of issue 41, <= 8 minutes on an H100/H200 (torch 2.11, Triton
#             3.6, 16 cores): env; build for this device's arch only (all cores); the Triton cache
#             warmed in parallel for every kernel the GPU tests and sanitize cases launch (its
#             compile count printed and in $OUT/triton-warm.json); the GPU tests, the master
#             step's first; compute-sanitizer memcheck on the accumulate kernels' and the master
#             step's sanitize cases; the headline numbers (flat 256M bf16->fp32 vs copy_, the
#             GPT-2-124M list vs the loops and _foreach_add_, host overhead for 300 tensors, the
#             step table's fused-master rows). Budget 450 s (AK_BUDGET). Without a GPU (or with
#             AK_CPU=1) it rehearses the same stages on the CPU: an in-place CPU build, the
#             interpreter, --quick benchmarks (the log: $OUT/session.log)
#             Plan on the GPU (s; cap in brackets, FIRST_PLAN below): env 10 [20], build 40 [85]
#             (one arch, 16 jobs: master_step_cuda.cu's instantiations need 8 s of CPU here),
#             triton-warm 40 [55] (only the Triton parametrisations, contiguous shards over 15
#             jobs, ~3 s per compile), pytest-master 25 [35], bench-headline 50 [60],
#             bench-step-master 35 [40], pytest-kernels 35 [40], memcheck accumulate 30 [35],
#             memcheck master 25 [30]: 290 s planned; worst case, every stage at its cap and
#             then killed: 400 + 9 x 5 s kill grace + 5 s summary = 450 s. The benchmarks run
#             before the kernel tests and the memchecks, so a long early stage cuts those.
#   all       (default) env, build, GPU tests, a bf16 benchmark, the four compute-sanitizer tools
#   check     env, build, GPU tests, the four compute-sanitizer tools
#   bench     env, build, the full benchmark (eager), the optimizer step (bench_step.py), the
#             kernels timed by CUDA-graph replay, overwrite=True
#   tune      env, build with each vector store (stwb, ptx) and time both; the Triton knob sweep;
#             the SASS both kernels compile to on this machine
#   train     env, build, benchmarks/bench_train.py (GPT-2 small) and find_micro_batch_size
#   host      env, build, the host-time table (benchmarks/bench_host.py): the wrapper's host time
#             per micro-batch and per step on 148 tiny params, and whether the host or the device
#             bounds a GPT-2-124M bf16 backward and step at batch 1 and 8 (CUDA events)
#   sanitize  env, build, the four compute-sanitizer tools with more time, memcheck twice
#   master    env, build, the fused master step on the GPU: its cuda and triton backends against
#             torch's own fused CUDA Adam/AdamW/SGD + cast, bit for bit
#             (tests/op/test_master_step_gpu.py), then the step table's fused-master rows
#             (AdamW and SGD-momentum, with and without clipping, vs the separate passes and
#             torch's fused step + copy-back; goal: within 10 % of the byte floor at the copy
#             bandwidth the kernel benchmark measures)
#
# Every stage runs under `timeout`, and the whole run stops starting stages once
# AK_BUDGET seconds (default 540) are nearly spent, so a call with timeout_s=600 always ends
# with its summary; a failing stage never stops the next one. Output: everything in
# $OUT/session.log (the tails of failed stages again in the summary, the Triton warm-up's shard
# logs in $OUT/triton-warm-logs), a partial-STAGE.json for a stage stopped by its cap, the summary
# as $OUT/stages-MODE.json (written on SIGTERM too), JSON records in $OUT (also copied to
# benchmarks/results/ of the device's tree, which does not come back: copy them from the call's
# files), the suites' tagged rows in $OUT/results/<suite>.jsonl (append them to the checkout's
# benchmarks/results/<suite>.jsonl), a summary table last.
# Environment: OUT (the device tool sets it), ACCUMKERNELS_GIT_COMMIT (the commit, recorded in
# every JSON; the device's tree has no git), PY (default python3), AK_BUDGET.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2

MODE=${1:-all}
OUT=${OUT:-/tmp/ak-out}
PY=${PY:-python3}
JOBS=${AK_JOBS:-$(nproc 2>/dev/null || echo 4)}
CPU_MODE=${AK_CPU:-}
# The suites' rows go where the call's files come back from, not into the device's tree.
export ACCUMBENCH_RESULTS_DIR=${ACCUMBENCH_RESULTS_DIR:-$OUT/results}
if [[ -z $CPU_MODE ]] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
    2>/dev/null; then CPU_MODE=1; fi
# the CPU rehearsal runs the same stages with 3x the caps and budget (a shared 2-core machine)
SCALE=$([[ -n $CPU_MODE ]] && echo 3 || echo 1)
if [[ $MODE == first ]]; then BUDGET=${AK_BUDGET:-$((450 * SCALE))}; else BUDGET=${AK_BUDGET:-540}; fi
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/ak-triton-cache}
STAGES=/tmp/ak-stages
KILL_AFTER=5  # seconds between a stage's SIGTERM at its cap and its SIGKILL
# first's stages in order, NAME:CAP in GPU seconds; worst case sum(caps) + 9 x KILL_AFTER +
# FIRST_SUMMARY_S must fit the 450 s budget (tests/test_gpu_session_tools.py checks it)
FIRST_PLAN="env:20 build:85 triton-warm:55 pytest-master:35 bench-headline:60 \
bench-step-master:40 pytest-kernels:40 sanitize-memcheck:35 sanitize-memcheck-master:30"
FIRST_SUMMARY_S=5
mkdir -p "$OUT" "$STAGES" benchmarks/results
export PYTHONUNBUFFERED=1 ACCUMKERNELS_GIT_COMMIT=${ACCUMKERNELS_GIT_COMMIT:-}
SUMMARY=()
DATE=$(date -u +%F)
SLUG=unknown-gpu
TEST_FILES=(tests/op/test_accumulate.py tests/op/test_cuda_graphs.py tests/wgrad/test_wgrad.py
            tests/op/test_triton_backend.py tests/op/test_native_build.py
            tests/op/test_master_step_gpu.py)

# stage NAME CAP_SECONDS CMD...: run CMD with a time limit, its output also in $STAGES/NAME.log
stage() {
  local name=$1 cap=$(($2 * SCALE))
  shift 2
  local left=$((BUDGET - SECONDS - 25))
  if ((left < 30)); then
    SUMMARY+=("$name|-|0|skipped: out of time")
    return 0
  fi
  local limit=$((cap < left ? cap : left))
  echo
  echo "=== $name (limit ${limit}s, at ${SECONDS}s) $(date -u +%H:%M:%S)"
  local t0=$SECONDS
  if declare -F "$1" >/dev/null; then  # a function of this script (exported below)
    timeout --kill-after=$KILL_AFTER "$limit" bash -c '"$@"' _ "$@" 2>&1 \
      | tee "$STAGES/$name.log"
  else
    timeout --kill-after=$KILL_AFTER "$limit" "$@" 2>&1 | tee "$STAGES/$name.log"
  fi
  local rc=${PIPESTATUS[0]}
  local note
  note=$(stage_note "$name" "$rc" "$limit")
  SUMMARY+=("$name|$rc|$((SECONDS - t0))|$note")
  if ((rc == 124 || rc == 137)); then partial_json "$name" "$rc" "$limit" "$((SECONDS - t0))"; fi
  return 0
}

# $OUT/partial-NAME.json: what is known of a stage its cap stopped (its own JSON, if it writes
# one, may be missing or partial): the limit, the time, the tail of its log.
partial_json() {
  tail -n 20 "$STAGES/$1.log" 2>/dev/null | "$PY" -c '
import json, sys
json.dump({"stage": sys.argv[1], "rc": int(sys.argv[2]), "limit": int(sys.argv[3]),
           "seconds": int(sys.argv[4]), "partial": "stopped at its cap",
           "log_tail": sys.stdin.read().splitlines()}, open(sys.argv[5], "w"), indent=1)' \
    "$1" "$2" "$3" "$4" "$OUT/partial-$1.json" || true
}

# cap NAME: the stage's cap in first's plan
cap() {
  local entry
  for entry in $FIRST_PLAN; do
    [[ ${entry%%:*} == "$1" ]] && echo "${entry##*:}" && return 0
  done
  echo "gpu_session.sh: no cap for $1 in FIRST_PLAN" >&2
  echo 30
}

# The worst case of first's plan: every stage to its cap, then its kill grace, then the summary.
plan_worst_case() {
  local entry sum=0 n=0
  for entry in $FIRST_PLAN; do sum=$((sum + ${entry##*:})); n=$((n + 1)); done
  echo "$((sum + n * KILL_AFTER + FIRST_SUMMARY_S))"
}

# One line saying how a stage went, read from its log.
stage_note() {
  local name=$1 rc=$2 limit=$3 log="$STAGES/$1.log"
  if ((rc == 124 || rc == 137)); then echo "TIMED OUT after ${limit}s"; return; fi
  case $name in
    pytest*) grep -E "^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)|no tests ran" "$log" \
               | tail -1 | sed 's/=//g; s/^ *//' ;;
    sanitize*) { grep -o "ERROR SUMMARY: [0-9]* errors\?" "$log" | tail -1;
                 grep -o "RACECHECK SUMMARY: .*" "$log" | tail -1;
                 grep -E "^sanitize_cases: " "$log" | tail -1; } | tr '\n' ' ' ;;
    build*) grep -o "'cuda_vec_store': '[a-z]*'\|cuda_prepare(0): .*\|^arch: .*" "$log" \
              | tr '\n' ' ' ;;
    triton-warm*) grep -E "^triton-warm: " "$log" | tail -1 ;;
    *) grep -E "^wrote |copy_ [0-9.]+ GB/s; wrote" "$log" | tail -1 | cut -c1-100 ;;
  esac
}

stage_env() {
  nvidia-smi || echo "nvidia-smi failed"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit \
    --format=csv || true
  "$PY" - <<'EOF'
import sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| torch cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError as exc:
    print("triton: not importable:", exc)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}: {p.multi_processor_count} SMs, L2 {getattr(p, 'L2_cache_size', 0) >> 20} MiB, "
          f"{p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
EOF
  nvcc --version | tail -2 || echo "no nvcc"
  sanitizer_path || echo "no compute-sanitizer"
  echo "commit: ${ACCUMKERNELS_GIT_COMMIT:-unknown (set ACCUMKERNELS_GIT_COMMIT)}"
}

# build [stwb|ptx]: the extension in place, then what it reports
stage_build() {
  ACCUMKERNELS_CUDA=1 ACCUMKERNELS_CUDA_STORE=${1:-stwb} MAX_JOBS=16 \
    "$PY" -m pip install --no-build-isolation --no-deps -e . || return 1
  "$PY" - <<'EOF'
import accumkernels
from accumkernels import _C
print("build_info:", _C.build_info())
print("cuda_prepare(0):", repr(_C.cuda_prepare(0)))
print("available_backends:", accumkernels.available_backends("cuda"))
EOF
}

# build_first: the extension in place for this device's arch only (CPU mode: the CPU part),
# all cores; no pip (the CPU rehearsal must not install into a shared environment)
stage_build_first() {
  local arch=""
  if [[ -z $CPU_MODE ]]; then
    arch=$("$PY" -c "import torch; m, n = torch.cuda.get_device_capability(0); print(f'{m}{n}')")
  fi
  echo "arch: ${arch:-none (CPU rehearsal: no CUDA build)}, jobs $JOBS"
  if [[ -n $arch ]]; then
    ACCUMKERNELS_CUDA=1 ACCUMKERNELS_CUDA_ARCHS=$arch MAX_JOBS=$JOBS \
      "$PY" setup.py -q build_ext --inplace || return 1
  else
    ACCUMKERNELS_CUDA=0 MAX_JOBS=$JOBS "$PY" setup.py -q build_ext --inplace || return 1
  fi
  "$PY" - <<'EOF'
import accumkernels
from accumkernels import _C
from accumkernels.ops.backends import master_step_triton as mst
print("build_info:", _C.build_info())
if _C.build_info()["cuda"]:
    print("cuda_prepare(0):", repr(_C.cuda_prepare(0)))
print("available_backends:", accumkernels.available_backends("cuda"))
print("triton libdevice:", mst.libdevice_path() if mst.triton is not None else "no triton")
EOF
}

sanitizer_path() {
  command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null \
    || ls /usr/local/cuda-*/bin/compute-sanitizer 2>/dev/null | tail -1
}

# sanitize_tool TOOL CAP [ENV=VALUE...]: one compute-sanitizer tool over sanitize_cases.py, on
# the accumulate kernels only; again without the kernel filter if this version refuses it.
sanitize_tool() {
  local tool=$1 cap=$2 name="sanitize-$1${3:+-nocache}"
  shift 2
  local cs
  cs=$(sanitizer_path)
  if [[ -z $cs ]]; then
    SUMMARY+=("$name|-|0|skipped: no compute-sanitizer")
    return 0
  fi
  stage "$name" "$cap" env "$@" "$cs" --tool "$tool" --kernel-name kns=accumulate \
    --print-limit 20 --error-exitcode 9 "$PY" -m benchmarks.sanitize_cases
  if ! grep -q "ERROR SUMMARY" "$STAGES/$name.log" && ! grep -q "TIMED OUT" <<<"${SUMMARY[-1]}"; then
    stage "$name-unfiltered" "$cap" env "$@" "$cs" --tool "$tool" --print-limit 20 \
      --error-exitcode 9 "$PY" -m benchmarks.sanitize_cases
  fi
}

run_tests() {
  local timeout_flag=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && timeout_flag=(--timeout 240)
  # gpu-marked tests everywhere (tests/op/test_gpu_kernels.py, test_wgrad's), then the rest of the
  # kernel files (their CUDA parametrisations run here).
  stage pytest-gpu 200 "$PY" -m pytest -q -ra -p no:cacheprovider "${timeout_flag[@]}" -m gpu tests
  stage pytest-kernels 200 "$PY" -m pytest -q -ra -p no:cacheprovider "${timeout_flag[@]}" \
    -m "not gpu" "${TEST_FILES[@]}"
}

run_sanitizers() {  # CAP for each tool
  sanitize_tool memcheck "$1" PYTORCH_NO_CUDA_MEMORY_CACHING=1
  sanitize_tool racecheck "$1"
  sanitize_tool initcheck "$1"
  sanitize_tool synccheck "$1"
}

# first: the issue-41 call (see MODE above); the stage caps add up to more than the budget, so the
# later stages shrink or are skipped (and say so) when an earlier one runs long
FIRST_KERNEL_TESTS=(tests/op/test_accumulate.py tests/op/test_cuda_graphs.py
                    tests/op/test_gpu_kernels.py tests/op/test_triton_backend.py
                    tests/wgrad/test_wgrad.py)
run_first() {
  local quick=() dev=() sizes=(--flat-numel 256M --reps 30) only=()
  # CPU rehearsal: the script end to end; its tests are CI's, so only the gpu-marked ones (which
  # skip) go through the stages
  [[ -n $CPU_MODE ]] && quick=(--quick) && dev=(--device cpu) && sizes=(--flat-numel 1M) \
    && only=(-m gpu)
  echo "first: plan $FIRST_PLAN; worst case $(plan_worst_case) s (GPU seconds) of 450"
  stage build "$(cap build)" stage_build_first
  stage triton-warm "$(cap triton-warm)" "$PY" -m benchmarks.triton_warm --jobs "$JOBS" \
    --with-sanitize-cases --pytest-args "${only[*]}" --out "$OUT/triton-warm.json" \
    --logs "$OUT/triton-warm-logs" tests/op/test_master_step_gpu.py "${FIRST_KERNEL_TESTS[@]}"
  stage pytest-master "$(cap pytest-master)" "$PY" -m pytest -q -ra -p no:cacheprovider \
    "${only[@]}" tests/op/test_master_step_gpu.py
  # the benchmarks before the kernel tests and the memchecks: a long early stage cuts those
  local providers=accumkernels:cuda,accumkernels:triton,loop_literal,loop_add,foreach
  [[ -n $CPU_MODE ]] && providers=accumkernels:cpu,loop_literal,loop_add,foreach
  stage bench-headline "$(cap bench-headline)" "$PY" -m benchmarks.accumbench "${dev[@]}" \
    "${quick[@]}" --dtypes bf16 --workloads flat,gpt2 "${sizes[@]}" --providers "$providers" \
    --no-plot --out "$(bench_out -first)"
  stage bench-step-master "$(cap bench-step-master)" "$PY" -m benchmarks.accumbench step \
    "${dev[@]}" "${quick[@]}" --variants sum,clip --out "$OUT/step-$SLUG-$DATE-first.json"
  stage pytest-kernels "$(cap pytest-kernels)" "$PY" -m pytest -q -ra -p no:cacheprovider \
    "${only[@]}" "${FIRST_KERNEL_TESTS[@]}"
  local cs
  cs=$(sanitizer_path)
  if [[ -z $cs || -n $CPU_MODE ]]; then
    SUMMARY+=("sanitize-memcheck|-|0|skipped: no compute-sanitizer or no GPU")
  else
    # caching off for both: out-of-bounds accesses inside a pooled block are invisible to it
    stage sanitize-memcheck "$(cap sanitize-memcheck)" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
      "$cs" --tool memcheck --kernel-name kns=accumulate --print-limit 20 --error-exitcode 9 \
      "$PY" -m benchmarks.sanitize_cases --kernels accumulate
    stage sanitize-memcheck-master "$(cap sanitize-memcheck-master)" \
      env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$cs" --tool memcheck --kernel-name kns=master_step \
      --print-limit 20 --error-exitcode 9 "$PY" -m benchmarks.sanitize_cases --kernels master
  fi
  [[ -z $CPU_MODE ]] && keep "$(bench_out -first)" "$OUT/step-$SLUG-$DATE-first.json" \
    "$OUT/triton-warm.json"
  return 0
}

bench_out() { echo "$OUT/$SLUG-$DATE$1.json"; }

keep() {  # copy records into the device's benchmarks/results (the caller copies $OUT back)
  for f in "$@"; do [[ -f $f ]] && cp "$f" benchmarks/results/; done
  return 0
}

summary() {
  local records=()
  for f in "$OUT"/*.json; do [[ -f $f ]] && records+=("$f"); done
  local main
  main=$(ls "$OUT"/"$SLUG"-*.json 2>/dev/null | grep -v -- '-graph\|-overwrite' | head -1)
  local train
  train=$(ls "$OUT"/train-*.json 2>/dev/null | head -1)
  if [[ -n $main || -n $train ]]; then
    echo
    "$PY" -m benchmarks.targets $main $train 2>&1 | tail -30
  fi
  if [[ -f $(bench_out -graph) ]]; then
    echo "(graph-timed kernels:)"
    "$PY" -m benchmarks.targets "$(bench_out -graph)" 2>&1 | grep -E "x copy" | head -8
  fi
  for f in "$OUT"/tune-*.json; do
    [[ -f $f ]] || continue
    "$PY" - "$f" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{sys.argv[1].rsplit('/', 1)[-1]}: copy_ {r['copy']['gbps']:.0f} GB/s")
for x in r["rows"]:
    v = f"{x['gbps']:7.0f} GB/s {x['frac_copy']:.3f}x" if x.get("gbps") else x["status"]
    print(f"  {x['workload'][:20]:20} {x['dtype']:4} {x['backend']:6} {x['config'][:42]:42} {v}")
EOF
  done
  stages_json
  fold_failed_tails
  echo "files in \$OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
  echo
  echo "=== summary: mode $MODE, budget ${BUDGET}s, $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1), commit ${ACCUMKERNELS_GIT_COMMIT:-unknown}, ${SECONDS}s"
  printf '%-28s %4s %6s  %s\n' stage rc secs note
  local line
  for line in "${SUMMARY[@]}"; do
    IFS='|' read -r n rc s note <<<"$line"
    printf '%-28s %4s %6s  %s\n' "$n" "$rc" "$s" "${note:0:110}"
  done
}

# The last lines of every stage that failed or timed out (its full output is above).
fold_failed_tails() {
  local line n rc
  for line in "${SUMMARY[@]}"; do
    IFS='|' read -r n rc _ <<<"$line"
    [[ $rc == 0 || $rc == - || ! -f $STAGES/$n.log ]] && continue
    echo "--- $n (rc $rc): last lines"
    tail -n 8 "$STAGES/$n.log" | cut -c1-200
  done
}

# $OUT/stages-MODE.json: the summary table as JSON
stages_json() {
  printf '%s\n' "${SUMMARY[@]}" | "$PY" -c '
import json, sys
rows = [dict(zip(("stage", "rc", "seconds", "note"), ln.rstrip("\n").split("|", 3)))
        for ln in sys.stdin if ln.strip()]
json.dump({"mode": sys.argv[1], "total_seconds": int(sys.argv[2]), "budget": int(sys.argv[3]),
           "stages": rows}, open(sys.argv[4], "w"), indent=1)' "$MODE" "$SECONDS" "$BUDGET" \
    "$OUT/stages-$MODE.json"
}

export PY JOBS CPU_MODE
export -f stage_env stage_build stage_build_first sanitizer_path

main() {
  # stopped from outside (the device tool's limit): the summary so far, as JSON too
  trap 'SUMMARY+=("interrupted|143|$SECONDS|SIGTERM at ${SECONDS}s"); stages_json; exit 143' TERM
  echo "gpu_session.sh $MODE: budget ${BUDGET}s, out $OUT, $(date -u)"
  stage env "$(cap env)" stage_env  # nvidia-smi twice, torch and triton imported: ~10 s
  SLUG=$("$PY" -c "import torch; from benchmarks.accumbench.env import slugify; print(slugify(torch.cuda.get_device_name(0)))" 2>/dev/null || echo unknown-gpu)
  case $MODE in
    first)
      run_first
      ;;
    all | check)
      stage build 240 stage_build stwb
      run_tests
      if [[ $MODE == all ]]; then
        stage bench-bf16 200 "$PY" -m benchmarks.accumbench --dtypes bf16 --reps 30 --no-plot \
          --out "$(bench_out -bf16)"
        keep "$(bench_out -bf16)"
      fi
      run_sanitizers 75
      ;;
    bench)
      stage build 240 stage_build stwb
      stage bench-full 330 "$PY" -m benchmarks.accumbench --out "$(bench_out "")"
      stage bench-step 120 "$PY" -m benchmarks.accumbench step --out "$OUT/step-$SLUG-$DATE.json"
      stage bench-graph 120 "$PY" -m benchmarks.accumbench --timer graph --no-plot --no-overhead \
        --providers 'accumkernels:cuda,accumkernels:triton' --workloads flat,gpt2,llama7b \
        --flat-numel 256M --dtypes bf16,fp32 --out "$(bench_out -graph)"
      stage bench-overwrite 100 "$PY" -m benchmarks.accumbench --overwrite --dtypes bf16 \
        --reps 30 --no-plot --no-overhead --out "$(bench_out -overwrite)"
      keep "$(bench_out "")" "$OUT/step-$SLUG-$DATE.json" "$(bench_out -graph)" \
        "$(bench_out -overwrite)"
      ;;
    tune)
      stage build-stwb 240 stage_build stwb
      stage tune-stwb 200 "$PY" -m benchmarks.tune_kernels --label stwb --triton-grid sweep \
        --out "$OUT/tune-$SLUG-$DATE-stwb.json"
      stage build-ptx 180 stage_build ptx
      stage tune-ptx 100 "$PY" -m benchmarks.tune_kernels --label ptx --backends cuda \
        --out "$OUT/tune-$SLUG-$DATE-ptx.json"
      stage sass 60 "$PY" -m benchmarks.sass_check
      keep "$OUT"/tune-*.json
      ;;
    train)
      stage build 240 stage_build stwb
      stage bench-train 300 "$PY" -m benchmarks.bench_train --out "$OUT/train-$SLUG-$DATE.json"
      stage find-batch 150 "$PY" -m benchmarks.find_batch \
        --out "$OUT/find-batch-$SLUG-$DATE.json"
      keep "$OUT/train-$SLUG-$DATE.json" "$OUT/find-batch-$SLUG-$DATE.json"
      ;;
    host)
      stage build 240 stage_build stwb
      stage bench-host 240 "$PY" -m benchmarks.accumbench host --out "$OUT/host-time-$SLUG-$DATE.json"
      keep "$OUT/host-time-$SLUG-$DATE.json"
      ;;
    sanitize)
      stage build 240 stage_build stwb
      run_sanitizers 110
      sanitize_tool memcheck 110  # with the caching allocator: the captured cases too
      ;;
    master)
      stage build 240 stage_build stwb
      stage master-gpu-tests 200 "$PY" -m pytest -q -p no:cacheprovider -rs \
        tests/op/test_master_step_gpu.py
      stage bench-step-master 150 "$PY" -m benchmarks.accumbench step --variants sum,clip \
        --out "$OUT/step-$SLUG-$DATE-fused-master.json"
      keep "$OUT/step-$SLUG-$DATE-fused-master.json"
      ;;
    *)
      echo "unknown mode $MODE (first, all, check, bench, tune, train, host, sanitize, master)"
      ;;
  esac
  summary
}

main 2>&1 | tee "$OUT/session.log"
exit "${PIPESTATUS[0]}"
