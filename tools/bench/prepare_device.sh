#!/usr/bin/env bash
# Fill the git-ignored folders a GPU run carries to the device machine, from the project root:
#
#   bash tools/bench/prepare_device.sh
#
#   .gpu_shared/  the processor files (models/Qwen3-VL-4B-Instruct) and Geometry3K's
#                 validation.parquet from GLIMPSE_SHARED (default ../shared), which does not
#                 travel; gpu_suite.sh points GLIMPSE_SHARED at it
#   .whl/         ../shared/tools/device-wheels: megatron-core, a slimmed Ray, math-verify,
#                 datasets (the versions uv.lock pins)
#   .wq35/        Qwen3.5's kernels: fla-core 0.6.0 and megatron-core as wheels, tilelang and
#                 z3 packed by pack_tilelang.sh (fla's backward needs tilelang on Hopper with the
#                 image's Triton 3.6.0)
#
# .whl and .gpu_shared together, or .wq35 and .gpu_shared, stay under the 64 MiB a call
# carries; .whl and .wq35 do not, so a Qwen3.5 run installs .wq35 in a first call
# (`WHEEL_DIR=.wq35 bash tools/bench/gpu_suite.sh setup`) and runs in a second one on the same
# warm machine, carrying .whl. A folder already there is kept (delete it to fetch it again).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
shared=${GLIMPSE_SHARED:-$root/../shared}
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for d in .whl .wq35 .gpu_shared; do
  grep -qx "/$d/" "$exclude" 2>/dev/null || echo "/$d/" >>"$exclude"
done

if [ ! -d .gpu_shared ]; then
  mkdir -p .gpu_shared/models .gpu_shared/data/geo3k
  cp -r "$shared/models/Qwen3-VL-4B-Instruct" .gpu_shared/models/
  cp "$shared/data/geo3k/validation.parquet" .gpu_shared/data/geo3k/
fi
[ -d .whl ] || "$shared/tools/device-wheels"
if [ ! -d .wq35 ]; then
  bash tools/bench/pack_tilelang.sh .wq35
  megatron=$(awk '$0 == "name = \"megatron-core\"" {getline; gsub(/"/, "", $3); print $3; exit}' uv.lock)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .wq35 fla-core==0.6.0 "megatron-core==${megatron:?not in uv.lock}"
fi
du -sh .gpu_shared .whl .wq35
