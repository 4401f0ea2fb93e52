#!/usr/bin/env bash
# Run the GPU benchmarks on a machine without the project's environment (the device machine:
# Python 3.12, torch 2.11, transformers 5.17, offline). Wheels for what it lacks come from .whl/
# (fill it with ../shared/tools/device-wheels; tools/bench/prepare_device.sh fills it, .wq35/ and
# .gpu_shared/ at once). Each benchmark's JSON and one log go to $OUT.
#
#   bash tools/bench/gpu_suite.sh [logprobs] [patch_embed] [hf_engine] [fsdp_train] [fsdp_accum] [megatron_parity] [weight_sync] [qwen35]
#     [hf_dense] [hf_families] [microscope] [delta_rule] [host_optimizer] [megatron_train] [megatron_compiled] [megatron_profile] [megatron_accum] [megatron_flat] [hf_geo3k] [ipc_probe] [e2e] [e2e_folder] [model_load] ...
#
# Wheels past the carry limit together (Ray in .whl/ and fla + tilelang in .wq35/, 91 MB) go in
# two calls on one warm machine (it is kept 30 s after a call; /tmp/site stays): first
# `WHEEL_DIR=.wq35 bash tools/bench/gpu_suite.sh setup` carrying .wq35, then at once the run
# itself carrying .whl, e.g. `E2E_BACKENDS=megatron E2E_BENCH_ARGS="--shape qwen3.5-35b-a3b
# --layers 8" bash tools/bench/gpu_suite.sh e2e` (with the same E2E_BENCH_ARGS, `setup
# e2e_folder` in the first call writes the model folder there).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# WHEEL_DIR (default .whl, git-ignored, carried): wheels, and *.tar.xz of an installed
# site-packages tree for packages whose wheels together pass the 64 MiB carry limit (xz packs
# them tighter; see docs/megatron.md for tilelang's)
wheels=${WHEEL_DIR:-.whl}
mkdir -p /tmp/site
for t in "$wheels"/*.tar.xz; do [ -f "$t" ] && tar -xJf "$t" -C /tmp/site; done
if ls "$wheels"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheels"/*.whl
  # the slimmed Ray's vendored dist-infos carry empty RECORD files, which make
  # importlib.metadata (called by transformers at import) raise once Ray is imported first
  find /tmp/site/ray -path '*.dist-info/RECORD' -size -2c -delete 2>/dev/null
fi
export PYTHONPATH=/tmp/site:$(ls -d packages/*/src apps/*/src | paste -sd:)
# ../shared does not travel: a git-ignored copy of what the benchmarks read (processor files,
# geo3k's validation.parquet) is carried as .gpu_shared
[ -d .gpu_shared ] && export GLIMPSE_SHARED=$PWD/.gpu_shared
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log="$OUT/log.txt"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "gpus", torch.cuda.device_count())'
} >>"$log" 2>&1
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
last_rc=0
run() {  # name timeout command...
  local name=$1 t=$2; shift 2
  echo "===== $name: $*" >>"$log"
  local s=$SECONDS
  timeout "$t" "$@" >>"$log" 2>&1
  last_rc=$?
  echo "===== $name rc=$last_rc in $((SECONDS - s)) s" >>"$log"
}
ipc_ok=1
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
      host_optimizer)  # the Megatron host step: megatron-core's own vs in pieces, 8B layer shapes
        run host_optimizer 300 python3 tools/bench/bench_host_optimizer.py --device cuda \
          --layers "${HOST_OPT_LAYERS:-8}" --out "$OUT/host_optimizer.json" ;;
      megatron_train)  # MegatronActor.train_step beside the FSDP actor ("ours"), same shape and batch
        run megatron_train 360 python3 tools/bench/bench_fsdp_train.py --device cuda --skip-baseline --variants megatron --out "$OUT/megatron_train.json" ;;
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
      megatron_compiled)  # MegatronConfig.compile (layers, vision blocks, log-prob kernels, the
        # default on CUDA): alone and bounded, as its first step once ran past 3.5 min (2026-12-01;
        # 102 s for build, compile and all steps on 2026-12-02)
        run megatron_compiled "${MEGATRON_COMPILED_TIMEOUT:-420}" python3 tools/bench/bench_fsdp_train.py --device cuda --skip-baseline \
          --variants megatron-compiled --out "$OUT/megatron_compiled.json" ;;
      megatron_profile)  # one Megatron train step as users run it (compiled) under torch.profiler,
        # beside the FSDP actor's
        run megatron_profile "${MEGATRON_PROFILE_TIMEOUT:-300}" python3 tools/bench/bench_fsdp_train.py --device cuda --skip-baseline \
          --variants megatron-compiled --steps 3 --host-phases --profile "$OUT/profile" ;;
      megatron_flat)  # one micro-batch per step: the Megatron actor (flat masters, the default)
        # against megatron-core's per-parameter optimizer bookkeeping, beside the FSDP actor
        run megatron_flat "${MEGATRON_FLAT_TIMEOUT:-300}" python3 tools/bench/bench_fsdp_train.py --device cuda --skip-baseline \
          --host-phases --variants megatron-compiled,megatron-per-param --out "$OUT/megatron_flat.json" ;;
      megatron_accum)  # both actors and the plain loop at four micro-batches per optimizer step,
        # as the launcher's GRPO step runs (16 x 8 samples: 5-7 micro-batches of 16,384 tokens)
        run megatron_accum "${MEGATRON_ACCUM_TIMEOUT:-420}" python3 tools/bench/bench_fsdp_train.py --device cuda --accum 4 \
          --steps "${ACCUM_STEPS:-10}" --host-phases --variants megatron-compiled --out "$OUT/megatron_accum.json" ;;
      hf_geo3k)  # the engine on the loop's own rollout: Geometry3K prompts, 16 x 8, 384 tokens
        run hf_geo3k 300 python3 tools/bench/bench_hf_engine.py --device cuda --geo3k "$GLIMPSE_SHARED/data/geo3k" \
          --batch-sizes 128 --new-tokens 384 --variants graph --out "$OUT/hf_geo3k.json"
        run hf_geo3k_profile 300 python3 tools/bench/bench_hf_engine.py --device cuda --geo3k \
          "$GLIMPSE_SHARED/data/geo3k" --batch-sizes 128 --profile "$OUT/hf_geo3k_profile.txt" ;;
      decode_attention) run decode_attention 300 python3 tools/bench/bench_decode_attention.py --out "$OUT/decode_attention.json"
        run hf_attention 540 python3 tools/bench/bench_hf_engine.py --device cuda --batch-sizes 128,256 --prompt-len 520 \
          --variants graph-sdpa,graph-triton --skip-baseline --out "$OUT/hf_attention.json"
        run decode_attention_tests 300 python3 -m pytest -q -p no:cacheprovider packages/rollout-sglang/tests/test_decode_attention.py \
          packages/rollout-sglang/tests/test_hf_engine_gpu.py ;;
      hf_profile) run hf_profile 200 python3 tools/bench/bench_hf_engine.py --device cuda --profile "$OUT/hf_profile.txt" ;;
      hf_engine) run hf_engine 540 python3 tools/bench/bench_hf_engine.py --device cuda --variants graph,graph-matmul,graph-compile --out "$OUT/hf_engine.json" ;;
      hf_dense)  # the 2B shape at the GRPO step's batch and above, against the roofline
        run hf_dense 300 python3 tools/bench/bench_hf_engine.py --device cuda --variants "${DENSE_VARIANTS:-graph}" \
          --batch-sizes 128,256 --out "$OUT/hf_dense.json" ;;
      hf_families)  # the MoE and Qwen3.5 shapes cut to FAMILY_LAYERS layers: the decode step
        # against the transformers loop (legacy) and model.generate, one run each
        for p in ${FAMILY_PRESETS:-qwen3-vl-30b-a3b qwen3.5-35b-a3b}; do
          run "hf_$p" 270 python3 tools/bench/bench_hf_engine.py --device cuda --preset "$p" \
            --layers "${FAMILY_LAYERS:-8}" --batch-sizes "${FAMILY_BATCHES:-128}" \
            --new-tokens "${FAMILY_NEW_TOKENS:-128}" --variants graph,legacy --check 2 --out "$OUT/hf_$p.json"
        done ;;
      weight_sync)  # colocated sync, object store vs CUDA IPC, FSDP and Megatron (GLIMPSE_SHARED: the processor)
        run weight_sync 540 python3 tools/bench/bench_weight_sync.py --out "$OUT/weight_sync.json" ;;
      ipc_probe)  # the real CUDA IPC handle exchange between two processes on this GPU
        run ipc_probe 120 python3 -m pytest -q -p no:cacheprovider -m gpu -k real_cuda_ipc \
          packages/rollout-sglang/tests/test_cuda_ipc.py
        [ "$last_rc" = 0 ] || ipc_ok=0 ;;
      e2e)  # the launcher, 5 colocated GRPO steps per backend (issue #19 / #22 harness); if the
        # IPC probe failed, the weights go through the object store so the other phases still time.
        # E2E_BENCH_ARGS: more bench options (--shape qwen3.5-35b-a3b --layers 8); E2E_ARGS:
        # launcher flags
        transport=(); [ "$ipc_ok" = 1 ] || transport=(--weight-transport object-store)
        run e2e "${E2E_TIMEOUT:-540}" python3 tools/bench/bench_grpo_e2e.py --steps "${E2E_STEPS:-5}" \
          --backends "${E2E_BACKENDS:-fsdp,megatron}" --timeout "${E2E_BACKEND_TIMEOUT:-240}" \
          --after-last-step 20 --work-dir /tmp/e2e --prune-models --out "$OUT/e2e.json" ${E2E_BENCH_ARGS:-} \
          -- ${E2E_ARGS:-} "${transport[@]}"
        for f in /tmp/e2e/*.log; do [ -f "$f" ] && tail -c 400000 "$f" >"$OUT/e2e_$(basename "$f")"; done ;;
      e2e_folder)  # only e2e's random-init model folder (E2E_BENCH_ARGS' shape), reused by a
        # later e2e on this warm machine: built in the setup call, it leaves e2e's call the whole
        # 10 minutes for the runs (the 8-layer Qwen3.5 cut's 16 GB folder)
        run e2e_folder "${FOLDER_TIMEOUT:-240}" python3 tools/bench/bench_grpo_e2e.py --backends "" \
          --work-dir /tmp/e2e --prune-models ${E2E_BENCH_ARGS:-} ;;
      model_load)  # the FSDP one-rank model phase: a bf16 checkpoint widened first against
        # loaded as stored; the 8B with the optimizer 90 % on the host (reuses e2e's folder)
        run model_load "${LOAD_TIMEOUT:-420}" python3 tools/bench/bench_model_load.py --device cuda \
          --shape "${LOAD_SHAPE:-qwen3-vl-8b}" --host-fraction "${LOAD_HOST_FRACTION:-0.9}" \
          --work-dir /tmp/e2e --out "$OUT/model_load.json" ;;
      qwen35)  # Qwen3.5-35B-A3B cut to 4 layers, GRPO steps on Megatron: fla vs the torch
        # gated delta net, packed vs one sample per micro-batch (needs fla-core in .whl/, and
        # on Hopper with Triton < 3.7.1 tilelang for fla's backward)
        run qwen35 480 python3 tools/bench/bench_qwen35_megatron.py --device cuda --out "$OUT/qwen35.json" ;;
      microscope)  # where the engine's and the trainers' log-probs part (tools/logprob_microscope.py),
        # per MICRO_SHAPES entry "shape:layers" (layers empty: the whole model); needs fla-core and
        # megatron-core in WHEEL_DIR for Qwen3.5 and the Megatron trainer; MICRO_ARGS: more tool
        # options (--dtypes float32), MICRO_TAG: a suffix of the JSON's name
        for s in ${MICRO_SHAPES:-qwen3.5-35b-a3b:8}; do
          shape=${s%%:*}; layers=${s#*:}
          run "microscope_$shape" "${MICRO_TIMEOUT:-300}" python3 tools/logprob_microscope.py --device cuda \
            --shape "$shape" ${layers:+--layers "$layers"} --work-dir /tmp/e2e --trainers "${MICRO_TRAINERS:-fsdp,megatron}" \
            --prompts "${MICRO_PROMPTS:-4}" --samples 2 --max-new-tokens "${MICRO_TOKENS:-128}" \
            --out "$OUT/microscope_${shape}${layers:+_${layers}l}${MICRO_TAG:+_$MICRO_TAG}.json" ${MICRO_ARGS:-}
        done ;;
      delta_rule)  # fla's chunked delta rule on float32 against bf16 inputs, forward and backward,
        # each against the float64 rule (vlm_models' use_float32_delta_rule); needs fla-core (and
        # on Hopper with Triton < 3.7.1 tilelang) in WHEEL_DIR
        run delta_rule 300 python3 -m pytest -q -s -m gpu -p no:cacheprovider \
          packages/vlm-models/tests/hf/test_gpu.py -k delta_rule ;;
      gpu_tests) run gpu_tests 420 python3 -m pytest -q -m gpu -p no:cacheprovider -o log_level=WARNING packages ;;
      setup) ;;  # only install WHEEL_DIR into /tmp/site (see the header)
      *) echo "unknown benchmark $w" >>"$log" ;;
    esac
  done
done
cat "$log"
