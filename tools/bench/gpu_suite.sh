#!/usr/bin/env bash
# Run the GPU benchmarks on a machine without the project's environment (the device machine:
# Python 3.12, torch 2.11, transformers 5.17, offline). Wheels for what it lacks come from .whl/
# (fill it with ../shared/tools/device-wheels). Each benchmark's JSON and one log go to $OUT.
#
#   bash tools/bench/gpu_suite.sh [logprobs] [patch_embed] [hf_engine] [fsdp_train] [fsdp_accum] [megatron_parity] ...
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$(ls -d packages/*/src | paste -sd:)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log="$OUT/log.txt"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "gpus", torch.cuda.device_count())'
} >>"$log" 2>&1
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
run() {  # name timeout command...
  local name=$1 t=$2; shift 2
  echo "===== $name: $*" >>"$log"
  local s=$SECONDS
  timeout "$t" "$@" >>"$log" 2>&1
  echo "===== $name rc=$? in $((SECONDS - s)) s" >>"$log"
}
for what in "${@:-logprobs patch_embed megatron_parity fsdp_train hf_engine}"; do
  for w in $what; do
    case $w in
      logprobs) run logprobs 120 python3 tools/bench/bench_logprobs.py --device cuda --out "$OUT/logprobs.json"
        run logprobs_compiled 120 python3 tools/bench/bench_logprobs.py --device cuda --compiled --out "$OUT/logprobs_compiled.json" ;;
      patch_embed) run patch_embed 150 python3 tools/bench/bench_patch_embed.py --device cuda --out "$OUT/patch_embed.json" ;;
      megatron_parity) run megatron_parity 180 python3 tools/bench/bench_megatron_parity.py --device cuda --out "$OUT/megatron_parity.json" ;;
      fsdp_train) run fsdp_train 540 python3 tools/bench/bench_fsdp_train.py --device cuda --variants "${FSDP_VARIANTS:-fsdp_one_rank}" --out "$OUT/fsdp_train.json" ;;
      fsdp_accum)  # four micro-batches per optimizer step, as a GRPO step over a global batch
        run fsdp_accum 540 python3 tools/bench/bench_fsdp_train.py --device cuda --accum 4 --host-phases --out "$OUT/fsdp_accum.json" ;;
      fsdp_variants)
        run fsdp_eager 240 python3 tools/bench/bench_fsdp_train.py --device cuda --skip-baseline --no-compile --out "$OUT/fsdp_eager.json"
        run fsdp_profile 300 python3 tools/bench/bench_fsdp_train.py --device cuda --skip-baseline --steps 2 --profile "$OUT/profile" --sync-debug "$OUT/syncs" ;;
      fsdp_scaling)  # ours on 2 and 4 GPUs (same per-GPU batch), FSDP and replicated; compare
        # with fsdp_train's 1 GPU
        for n in 2 4; do
          [ "$ngpu" -ge "$n" ] && run "fsdp_${n}gpu" 420 torchrun --standalone --nproc-per-node "$n" \
            tools/bench/bench_fsdp_train.py --device cuda --skip-baseline --variants "${SCALING_VARIANTS:-replicate}" \
            --out "$OUT/fsdp_train_${n}gpu.json"
        done ;;
      hf_profile) run hf_profile 200 python3 tools/bench/bench_hf_engine.py --device cuda --profile "$OUT/hf_profile.txt" ;;
      hf_engine) run hf_engine 540 python3 tools/bench/bench_hf_engine.py --device cuda --variants graph,graph-matmul,graph-compile --out "$OUT/hf_engine.json" ;;
      gpu_tests) run gpu_tests 420 python3 -m pytest -q -m gpu -p no:cacheprovider -o log_level=WARNING packages ;;
      *) echo "unknown benchmark $w" >>"$log" ;;
    esac
  done
done
cat "$log"
