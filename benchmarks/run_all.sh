#!/usr/bin/env bash
# Reproduce benchmarks/results/: heron vs HF transformers offline (throughput, latency), serve
# sweeps against heron and, where installed, llama-cpp-python's server, then the report.
# Run on a quiet machine: `make bench` (or benchmarks/run_all.sh). Knobs (environment):
#   THREADS      threads for every engine (default: all cores)
#   PRICE        $ per device-hour for the cost section (default 0.10, a small cloud VM)
#   OUT          output directory (default benchmarks/results)
#   LLAMA_VENV   a venv with `llama-cpp-python[server]` (default .venv/llamacpp; skipped if absent)
#   QUICK=1      a smoke run in a few minutes (tiny workloads; not for the committed report)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
HERON="$PY -m heron.entrypoints.cli"
OUT=${OUT:-benchmarks/results}
RAW=$OUT/raw
THREADS=${THREADS:-$(nproc)}
PRICE=${PRICE:-0.10}
LLAMA_VENV=${LLAMA_VENV:-.venv/llamacpp}
export OMP_NUM_THREADS=$THREADS  # also for the launched heron server
mkdir -p "$RAW"

if [[ "${QUICK:-0}" == 1 ]]; then
  TP=(--num-prompts 8 --input-len 32:64 --output-len 16:32)
  LAT=(--batch-sizes 1,4 --input-len 32 --output-len 16 --iters 1)
  SERVE=(--num-prompts 6 --input-len 32 --output-len 16 --request-rates 2,inf)
else
  # The nano-vllm workload (256 x U[100,1024] in and out) is the default of `bench
  # throughput`; on a 2-core CPU it would run for hours, so the CPU report uses a quarter.
  TP=(--num-prompts 64 --input-len 100:512 --output-len 100:256)
  LAT=(--batch-sizes 1,8 --input-len 128 --output-len 128 --iters 3)
  SERVE=(--num-prompts 32 --input-len 128 --output-len 128 --request-rates 0.5,1,2,4,inf)
fi
SLO=ttft=2000,tpot=250

$HERON bench throughput --peer hf --threads "$THREADS" --max-model-len 2048 "${TP[@]}" \
  --json-out "$RAW/throughput.json"
$HERON bench latency --peer hf --threads "$THREADS" --roofline on "${LAT[@]}" \
  --json-out "$RAW/latency.json"
$HERON bench serve --launch --server-args "--max-model-len 2048" --label heron --slo "$SLO" \
  "${SERVE[@]}" --json-out "$RAW/serve_heron.json"

if [[ -x "$LLAMA_VENV/bin/python" ]] && "$LLAMA_VENV/bin/python" -c "import llama_cpp.server" \
    2>/dev/null; then
  GGUF=$($PY -c "from heron.loader.gguf_loader import find_default_gguf as f; print(f())")
  PORT=$($PY -c "from heron.bench.launch import free_port; print(free_port())")
  # interrupt_requests False: by default a new request cuts the running stream short.
  "$LLAMA_VENV/bin/python" -m llama_cpp.server --model "$GGUF" --host 127.0.0.1 \
    --port "$PORT" --n_ctx 4096 --n_threads "$THREADS" --n_threads_batch "$THREADS" \
    --interrupt_requests False > "${TMPDIR:-/tmp}/heron-llamacpp-server.log" 2>&1 &
  LLAMA_PID=$!
  trap 'kill $LLAMA_PID 2>/dev/null || true' EXIT
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && break
    kill -0 $LLAMA_PID 2>/dev/null || { echo "llama_cpp.server exited" >&2; exit 1; }
    sleep 1
  done
  # It ignores ignore_eos (a reply may stop early) and serves one request at a time.
  $HERON bench serve --url "http://127.0.0.1:$PORT" --label llama-cpp-python --slo "$SLO" \
    "${SERVE[@]}" --json-out "$RAW/serve_llamacpp.json"
  kill $LLAMA_PID && wait $LLAMA_PID 2>/dev/null || true
else
  echo "llama-cpp-python not found in $LLAMA_VENV: skipping its serve sweep" >&2
fi

$HERON bench report "$RAW"/*.json --out-dir "$OUT" --gpu-hour-price "$PRICE" \
  --target-rate 10 --title "heron on SmolLM2-135M-Instruct: offline, latency and serving"
