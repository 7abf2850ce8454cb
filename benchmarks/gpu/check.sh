#!/usr/bin/env bash
# The GPU checks of issue 14 as one prepared run, for a lent GPU machine (the device tool's `run`),
# where device time is short (15 minutes a task, each machine start included) and every failed call
# costs a start. Prepare here first (benchmarks/gpu/prepare.sh: wheels and stubs into .gpu/), then
# one call:
#
#   run(command="bash benchmarks/gpu/check.sh once", carry=[".gpu"], timeout_s=570)
#
# `once` runs every phase, most valuable first, within GPU_CHECK_BUDGET_S (default 540 s): each
# phase runs under its own limit, cut to what the budget has left, and a phase that would get under
# 20 s is skipped. A setup failure stops at once (cheap to fix and rerun); any other failure goes
# on to the next phase. Each phase's log lands under $OUT as it ends (a phase killed by its limit
# leaves what it printed too). Phases:
#   setup   install .gpu's wheels into /tmp/site, copy the stubs, check the imports, print the
#           machine (GPU, driver, torch, transformers, triton)
#   smoke   benchmarks/gpu/smoke.py: the toolchain Triton needs, the attention kernel against a
#           float64 reference (bf16 and fp32), the default CUDA engine against the reference engine,
#           host syncs per captured step, the draft's steps run ahead, the draft's picks as CUDA
#           graphs (their capture cost); one line each. If the attention kernel, the default engine,
#           run ahead or the pick graphs fail here, the later phases run with the failing part off
#           (SPECD_ATTENTION=sdpa, SPECD_FUSED_LAYERS=off, SPECD_RUN_AHEAD=off, SPECD_PICK_GRAPHS=off:
#           which, by benchmarks/gpu/switches.py) so their figures still come back, and phases.txt says so
#   steps   `specd steps` on random-weight Qwen2.5-0.5B and 7B: decode and verify steps, graphs
#           and eager, fused layers on and off, as multiples of the bandwidth floor
#   bench   `specd bench --pair synth-0.5b-7b`: target-only through the service, HF eager
#           generate, specdec's round costs at k = 2, 4, 6, projected speedups, 1 and 8 streams
#   heads   `specd steps` on the draft with its full head and heads of 32768, 16384 and 8192 ids
#           (issue 15's trimmed draft vocabulary; the lowest ids on random weights: costs only),
#           and with each a Propose of 4 per drafted token, its steps one at a time vs run ahead
#           (--propose: each step fed the step before's picks on the device, no sync between), and
#           run ahead at T = 0.7 (what the sampled picks add to a step): its picks replayed as CUDA
#           graphs, launched one by one (eager picks), and with every other session greedy
#   ahead   the bench's fixed k = 4 rows again with SPECD_RUN_AHEAD=off (the draft's steps one at
#           a time, a host sync each), against the bench phase's, run ahead (the default on CUDA)
#   overhead `specd overhead` (issue 15) on this host's CPUs: in-process, deployed (with the
#           orchestrator's own round through Generate), and in-process with idle CPUs kept polling
#           (--cpu-wake-latency-us 0: how much is wake-ups)
#           (deployed: that layout alone, for GPU_CHECK_PHASES)
#   hops    `specd overhead --hops`: the orchestrator's own round cut into what each process and
#           each crossing between them took (issue 15: where the many-core host's round goes), with
#           busy polling as the roles' default would have it with their models on a GPU (on, where
#           the host has 4 CPUs or more: specdec/busy_poll.py)
#   nopoll  the hops again with busy polling off (--busy-poll-us 0): what the default's polling saves
#   busy    the hops again with every process polling up to 50 ms a wait (--busy-poll-us 50000),
#           whatever the host
#   tests   the gpu-marked tests: CUDA-graph steps == eager (fp32), batched == alone, the bf16
#           identity rate, exactness with the orchestrator on the GPU, one host sync per step
#   static  `specd bench --policies none --baselines hf-static`: HF generate on a static cache,
#           compiled (the slowest phase to start, so last)
# Other modes: quick = setup smoke tests steps; bench = setup bench static; all = once.
#
# GPU_CHECK_DEVICE=cpu runs the same phases on this machine's CPU with the tiny synthetic models (a
# dry run of the plumbing: PYVER=3.11 DEST=.gpu-py311 prepare.sh first, GPU_CHECK_PREPARED=.gpu-py311, and a Python without the project
# installed, to see what the GPU image lacks). $OUT (the device tool sets it) gets at most 8
# files, as the device tool returns, and has exactly 8 now: phases.txt, logs.txt (every phase's
# log, appended as each ends), steps.md, bench-summary.md, heads.md, ahead-off-summary.md,
# static-summary.md and results.tgz (everything, the services' logs included).
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
mode=${1:-once}
budget=${GPU_CHECK_BUDGET_S:-540}  # seconds for all phases of this call
device=${GPU_CHECK_DEVICE:-cuda}
out=${OUT:-$root/gpu-check-out}
work=${GPU_CHECK_WORK:-/tmp/gpu-check}
site=${GPU_CHECK_SITE:-/tmp/site}
python=${PYTHON:-python3}
prepared=${GPU_CHECK_PREPARED:-.gpu}  # what prepare.sh made (DEST there)
case "$work" in  # emptied below: only a folder of its own under /tmp
  /tmp/?*) ;;
  *) echo "GPU_CHECK_WORK must be a folder under /tmp (it is emptied first): $work" >&2; exit 2 ;;
esac
rm -rf "$work"  # a warm machine keeps /tmp between calls; the bench refuses a used folder
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1

if [ "$device" = cpu ]; then
  draft_model=synth:tiny target_model=synth:tiny pair=synth-tiny dtype=float32
  bench_size=(--token-prompts 2 --max-tokens 16 --concurrency 1 2)
  heads=(0 256 128)
else
  draft_model=synth:qwen2.5-0.5b target_model=synth:qwen2.5-7b pair=synth-0.5b-7b dtype=bfloat16
  bench_size=(--token-prompts 3 --max-tokens 64 --concurrency 1 8)
  heads=(0 32768 16384 8192)
  # The services and the HF baselines share one GPU: half the free memory each (the engine's
  # default) would leave the HF baselines none. 8 GiB holds 8 streams of a 7B at its full context.
  export SPECD_MAX_KV_BYTES=${SPECD_MAX_KV_BYTES:-$((8 << 30))}
fi

phase() {  # phase NAME LIMIT_S COMMAND...: run under min(LIMIT_S, what the budget has left), log, record
  local name=$1 limit=$2 t0=$SECONDS rc left
  shift 2
  left=$((budget - SECONDS - 5))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    printf '%-8s skipped: %ss of the %ss budget left\n' "$name" "$((budget - SECONDS))" "$budget" | tee -a "$out/phases.txt"
    return 125
  fi
  echo "== $name (limit ${limit}s): $*"
  timeout -k 5 "$limit" "$@" > "$work/$name.log" 2>&1
  rc=$?
  [ "$rc" = 124 ] && echo "   (killed at its ${limit}s limit)" >> "$work/$name.log"
  { echo "===== $name rc=$rc $((SECONDS - t0))s: $*"; cat "$work/$name.log"; } >> "$out/logs.txt"
  printf '%-8s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$(grep -v '^\s*$' "$work/$name.log" | tail -n 1 | cut -c1-100)" \
    | tee -a "$out/phases.txt"
  return "$rc"
}

keep() {  # keep SRC NAME: a phase's summary, when it wrote one, among the files $OUT returns
  [ -f "$1" ] && cp "$1" "$out/$2"
}

setup() {
  set -e
  if [ -f "$prepared/python-version" ] && [ "$(cat "$prepared/python-version")" != "$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" ]; then
    echo "warning: $prepared was prepared for Python $(cat "$prepared/python-version"), this is $("$python" -V)"
  fi
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$prepared"/wheels/*.whl
  cp "$prepared"/stubs/*.py specdec/v1/
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null || true
  "$python" - <<'EOF'
import importlib, platform, sys
import torch, transformers
for mod in ("grpc", "google.protobuf", "opentelemetry.sdk.trace", "fastapi", "uvicorn", "specdec.cli.main",
            "specdec.v1.target_pb2_grpc", "draft_service.servicer", "target_service.servicer", "orchestrator.server"):
    importlib.import_module(mod)
import grpc, google.protobuf
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "none"
print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"triton {triton_version}, grpcio {grpc.__version__}, protobuf {google.protobuf.__version__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"cuda: {torch.cuda.get_device_name(0)}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
          f"capability {p.major}.{p.minor}, {torch.cuda.device_count()} device(s)")
else:
    print("cuda: not available")
print("imports ok")
EOF
}

export PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}"
specd=("$python" -m specdec.cli.main)
export python prepared site
export -f setup

echo "# $(date -u +%FT%TZ) mode=$mode device=$device budget=${budget}s commit=$(git describe --always --dirty 2>/dev/null || echo '?')" >> "$out/phases.txt"
case "$mode" in
  once|all) phases=(smoke steps bench heads ahead overhead tests hops nopoll busy static) ;;
  quick) phases=(smoke tests steps) ;;
  bench) phases=(bench static) ;;
  *) echo "unknown mode $mode: once, quick, bench or all" >&2; exit 2 ;;
esac
# A rerun of some phases only (say, after a fix): GPU_CHECK_PHASES="smoke bench deployed".
[ -n "${GPU_CHECK_PHASES:-}" ] && read -r -a phases <<< "$GPU_CHECK_PHASES"
phase setup 60 bash -c setup || { echo "setup failed: see $out/logs.txt"; cat "$work/setup.log"; exit 1; }
tail -n 3 "$work/setup.log"

bench=("${specd[@]}" bench --pair "$pair" --device "$device" --dtype "$dtype" --repeats 1 --no-progress)
for name in "${phases[@]}"; do
  case "$name" in
    smoke)
      interpret=$([ "$device" = cpu ] && echo 1 || echo 0)  # Triton on a CPU: its interpreter
      phase smoke 75 env SMOKE_DEVICE="$device" TRITON_INTERPRET="$interpret" "$python" benchmarks/gpu/smoke.py
      # What failed here stays off in the later phases, so they still measure the rest
      # (benchmarks/gpu/switches.py says which, and why).
      if [ "$device" != cpu ]; then
        while IFS=$'\t' read -r assignment why; do
          [ -n "$assignment" ] || continue
          export "${assignment?}"
          echo "         later phases: $assignment ($why)" | tee -a "$out/phases.txt"
        done < <("$python" benchmarks/gpu/switches.py "$work/smoke.log")
      fi ;;
    steps)
      phase steps 120 "${specd[@]}" steps "$draft_model" "$target_model" --device "$device" --dtype "$dtype" \
        --batches 1 8 --num-draft-tokens 4 --fused-layers auto off --out "$work/steps"
      keep "$work/steps/steps.md" steps.md ;;
    bench)
      # Random weights: the draft's confidence in its first draft is ~1/vocab, so the default
      # min confidence would end every round after one draft; 0 drafts all k, whose cost the
      # projections need.
      phase bench 180 "${bench[@]}" "${bench_size[@]}" --baselines service hf \
        --num-draft-tokens 2 4 6 --policies fixed --temperatures 0 0.7 --draft-min-confidence 0 \
        --assume-acceptance 0.7 0.8 0.85 --out "$work/bench"
      keep "$work/bench/summary.md" bench-summary.md ;;
    heads)  # issue 15: the draft's step with its full head and trimmed heads (random weights: costs only)
      phase heads 90 "${specd[@]}" steps "$draft_model" --device "$device" --dtype "$dtype" \
        --batches 1 8 --num-draft-tokens 4 --draft-vocab "${heads[@]}" --propose --out "$work/heads"
      keep "$work/heads/steps.md" heads.md ;;
    ahead)  # the bench's fixed k = 4 rows again with the draft's steps one at a time: run ahead's effect end to end
      if [ "${SPECD_RUN_AHEAD:-auto}" = off ]; then
        echo "ahead    skipped: run ahead is off for every phase already" | tee -a "$out/phases.txt"
        continue
      fi
      phase ahead 90 env SPECD_RUN_AHEAD=off "${bench[@]}" "${bench_size[@]}" --baselines service \
        --num-draft-tokens 4 --policies fixed --temperatures 0 0.7 --draft-min-confidence 0 --out "$work/ahead-off"
      keep "$work/ahead-off/summary.md" ahead-off-summary.md ;;
    overhead)
      # Third: in-process with idle CPUs polling (root there), to tell wake-ups from our code.
      sp=$(printf '%q ' "${specd[@]}")
      phase overhead 230 bash -c "$sp overhead --reps 150 --in-process; $sp overhead --reps 150 --orchestrator-requests 8; $sp overhead --reps 150 --in-process --cpu-wake-latency-us 0" ;;
    deployed)  # the overhead's deployed layout alone (each service a process)
      phase deployed 210 "${specd[@]}" overhead --reps 150 --orchestrator-requests 8 ;;
    hops)  # the orchestrator's round, hop by hop
      phase hops 90 "${specd[@]}" overhead --hops --orchestrator-requests 6 ;;
    nopoll)  # the same with busy polling off
      phase nopoll 90 "${specd[@]}" overhead --hops --orchestrator-requests 6 --busy-poll-us 0 ;;
    busy)  # the same with every process polling while a reply is due (--busy-poll-us, specdec/busy_poll.py)
      phase busy 90 "${specd[@]}" overhead --hops --orchestrator-requests 6 --busy-poll-us 50000 ;;
    tests)
      phase tests 90 "$python" -m pytest -q -rs -p no:cacheprovider -o timeout=60 -m gpu \
        tests/test_gpu_engine.py tests/test_device_picks.py tests/test_draft_run_ahead.py ;;
    static)
      phase static 120 "${bench[@]}" --token-prompts 3 --max-tokens 64 --concurrency 1 --baselines hf-static \
        --policies none --temperatures 0 --out "$work/static"
      keep "$work/static/summary.md" static-summary.md ;;
    *) echo "unknown phase $name (GPU_CHECK_PHASES): skipped" | tee -a "$out/phases.txt" ;;
  esac
done
tar -C "$work" -czf "$out/results.tgz" . 2>/dev/null
echo "== phases"; cat "$out/phases.txt"
