#!/usr/bin/env bash
# The GPU checks of issue 14 as one prepared run, for a lent GPU machine (the device tool's `run`),
# where device time is short (15 minutes a task, each machine start included) and every failed call
# costs a start. Prepare here first (benchmarks/gpu/prepare.sh: wheels and stubs into .gpu/), then:
#
#   run(command="bash benchmarks/gpu/check.sh quick", carry=[".gpu"], timeout_s=480)  # phases: at most 420 s, +10 s grace each
#   run(command="bash benchmarks/gpu/check.sh bench", carry=[".gpu"], timeout_s=420)  # within 30 s: warm; at most 390 s
#
# Phases, each under its own time limit, each leaving its log under $OUT as it ends (what a
# phase killed by its limit printed comes back too):
#   setup  install .gpu's wheels into /tmp/site, copy the stubs, check the imports, print the
#          machine (GPU, driver, torch, transformers, triton)
#   smoke  benchmarks/gpu/smoke.py: the toolchain Triton needs, the attention kernel against a
#          float64 reference (bf16 and fp32), the default CUDA engine against the reference engine,
#          host syncs per captured step; one line each
#   tests  the gpu-marked tests: CUDA-graph steps == eager (fp32), batched == alone, the bf16
#          identity rate, exactness with the orchestrator on the GPU, one host sync per step
#   steps  `specd steps` on random-weight Qwen2.5-0.5B and 7B: decode and verify steps, graphs
#          and eager, fused layers on and off, as multiples of the bandwidth floor
#   bench  `specd bench --pair synth-0.5b-7b`: target-only through the service, HF eager and
#          static-cache generate, specdec's round costs, projected speedups, 1 and 8 streams
# quick = setup smoke tests steps; bench = setup bench; all = every phase.
#
# GPU_CHECK_DEVICE=cpu runs the same phases on this machine's CPU with the tiny synthetic models (a
# dry run of the plumbing: PYVER=3.11 DEST=.gpu-py311 prepare.sh first, GPU_CHECK_PREPARED=.gpu-py311, and a Python without the project
# installed, to see what the GPU image lacks). $OUT (the device tool sets it) gets phases.txt,
# the phase logs, the steps and bench summaries and results.tgz (everything, the services' logs
# included); at most 8 files, as the device tool returns (quick leaves 8, bench 6).
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
mode=${1:-quick}
device=${GPU_CHECK_DEVICE:-cuda}
out=${OUT:-$root/gpu-check-out}
work=${GPU_CHECK_WORK:-/tmp/gpu-check}
site=${GPU_CHECK_SITE:-/tmp/site}
python=${PYTHON:-python3}
prepared=${GPU_CHECK_PREPARED:-.gpu}  # what prepare.sh made (DEST there)
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1

if [ "$device" = cpu ]; then
  draft_model=synth:tiny target_model=synth:tiny pair=synth-tiny dtype=float32
  bench_size=(--token-prompts 2 --max-tokens 16 --concurrency 1 2 --baselines service hf)
else
  draft_model=synth:qwen2.5-0.5b target_model=synth:qwen2.5-7b pair=synth-0.5b-7b dtype=bfloat16
  bench_size=(--token-prompts 3 --max-tokens 64 --concurrency 1 8 --baselines service hf hf-static)
  # The services and the HF baselines share one GPU: half the free memory each (the engine's
  # default) would leave the HF baselines none. 8 GiB holds 8 streams of a 7B at its full context.
  export SPECD_MAX_KV_BYTES=${SPECD_MAX_KV_BYTES:-$((8 << 30))}
fi

phase() {  # phase NAME LIMIT_S COMMAND...: run, log, record; never stops the script
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "== $name (limit ${limit}s): $*"
  timeout -k 10 "$limit" "$@" > "$work/$name.log" 2>&1
  rc=$?
  cp "$work/$name.log" "$out/$name.log"
  [ "$rc" = 124 ] && echo "   (killed at its ${limit}s limit)" >> "$out/$name.log"
  printf '%-6s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$work/$name.log" | cut -c1-100)" \
    | tee -a "$out/phases.txt"
  return "$rc"
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

echo "# $(date -u +%FT%TZ) mode=$mode device=$device commit=$(git rev-parse --short HEAD 2>/dev/null || echo '?')" >> "$out/phases.txt"
phase setup 60 bash -c setup || { echo "setup failed: see $out/setup.log"; cat "$out/setup.log"; exit 1; }
tail -n 3 "$out/setup.log"

if [ "$mode" = quick ] || [ "$mode" = all ]; then
  interpret=$([ "$device" = cpu ] && echo 1 || echo 0)  # Triton on a CPU: its interpreter
  phase smoke 90 env SMOKE_DEVICE="$device" TRITON_INTERPRET="$interpret" "$python" benchmarks/gpu/smoke.py
  phase tests 120 "$python" -m pytest -q -rs -p no:cacheprovider -o timeout=60 -m gpu \
    tests/test_gpu_engine.py tests/test_device_picks.py
  phase steps 150 "${specd[@]}" steps "$draft_model" "$target_model" --device "$device" --dtype "$dtype" \
    --batches 1 8 --num-draft-tokens 4 --fused-layers auto off --out "$work/steps"
  [ -f "$work/steps/steps.md" ] && cp "$work/steps/steps.md" "$out/steps.md"
fi
if [ "$mode" = bench ] || [ "$mode" = all ]; then
  phase bench 330 "${specd[@]}" bench --pair "$pair" --device "$device" --dtype "$dtype" "${bench_size[@]}" \
    --num-draft-tokens 2 4 6 --policies fixed --temperatures 0 --repeats 1 \
    --assume-acceptance 0.7 0.8 0.85 --no-progress --out "$work/bench"
  [ -f "$work/bench/summary.md" ] && cp "$work/bench/summary.md" "$out/bench-summary.md"
fi
tar -C "$work" -czf "$out/results.tgz" . 2>/dev/null
echo "== phases"; cat "$out/phases.txt"
