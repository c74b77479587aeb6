#!/usr/bin/env bash
# lm-evaluation-harness's loglikelihood (multiple-choice) requests against rollout's HTTP server, compared
# with lm-eval's own `hf` backend on the same model (docs/http_server.md, "lm-evaluation-harness").
#
#   bash tools/lm_eval_check/run.sh OUT_DIR [MODEL_DIR]
#
# Needs a venv with lm-eval[api]==0.4.13 and rollout-engine[server] (CPU is enough). MODEL_DIR defaults to
# the converted SmolLM2-135M-Instruct (python -m rollout.default_model). Runs lm-eval's `hf` backend, then
# `local-completions` (/v1/completions, echo) and `sglang-generate` (/generate, logprob_start_len) against
# the server; writes OUT_DIR/{hf,completions,generate}/ (lm-eval's results and samples) and prints
# tools/lm_eval_check/compare.py's comparison of each server run with the hf run.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$(mkdir -p "$1" && cd "$1" && pwd)"
model="${2:-$(python -m rollout.default_model)}"
tasks="$out/tasks"
mkdir -p "$tasks"
sed "s|PLACEHOLDER_DATA|$here/data.jsonl|" "$here/rollout_mc.yaml" > "$tasks/rollout_mc.yaml"
common=(--tasks rollout_mc --include_path "$tasks" --log_samples --batch_size 8)

lm_eval --model hf --model_args "pretrained=$model,dtype=float32" --device cpu --output_path "$out/hf" "${common[@]}"

port=$(python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
python -m rollout.launch_server --model-path "$model" --dtype float32 --device cpu --port "$port" \
  > "$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
  kill -0 $server 2>/dev/null || { cat "$out/server.log"; exit 1; }
  sleep 1
done
lm_eval --model local-completions --output_path "$out/completions" "${common[@]}" \
  --model_args "model=$model,base_url=http://127.0.0.1:$port/v1/completions,tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1"
lm_eval --model sglang-generate --output_path "$out/generate" "${common[@]}" \
  --model_args "model=$model,base_url=http://127.0.0.1:$port/generate,tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1"

status=0
for run in completions generate; do
  echo "== hf vs $run"
  python "$here/compare.py" "$out/hf" "$out/$run" || status=1
done
exit $status
