#!/usr/bin/env bash
# Pack tilelang and its native dependencies for the device machine (Python 3.12, x86-64) as one
# .tar.xz of an installed site-packages tree, into $1 (default .wq35/).
#
# Why: fla-core 0.6.0 refuses the backward of its gated delta rule on Hopper with Triton
# 3.4.0-3.7.0 (fla issue #640) unless tilelang is installed; the H200 image has Triton 3.6.0.
# tilelang's wheel (50 MB) and z3-solver's (29 MB) together pass the device tool's 64 MiB carry
# limit as wheels; unpacked, pruned (z3's command-line binary) and xz-packed they are ~45 MB.
# gpu_suite.sh unpacks every *.tar.xz of WHEEL_DIR into its site folder. Use: copy the fla_core
# and megatron_core wheels beside the archive, then `WHEEL_DIR=.wq35 bash tools/bench/gpu_suite.sh
# qwen35` with .wq35 carried to the device machine.
set -euo pipefail
dest=${1:-.wq35}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work/wheels" \
  tilelang==0.1.15 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4.0
mkdir -p "$work/site" "$dest"
for w in "$work"/wheels/*.whl; do unzip -qo "$w" -d "$work/site"; done
rm -rf "$work"/site/z3_solver-*.data
XZ_OPT=-T0 tar -cJf "$dest/tilelang-site.tar.xz" -C "$work/site" .
ls -la "$dest/tilelang-site.tar.xz"
