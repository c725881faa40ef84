#!/usr/bin/env bash
# The packages the H200 test machine lacks beyond the shared bundle (../shared/device/make-bundle.sh), as archives
# under .device/ for the device tool's `carry` (64 MiB per call):
#
#   .device/fa4libs.tar.xz  nvidia-cutlass-dsl-libs-cu13 (~61 MiB), also cut into .device/fa4libs.tar.xz.aa / .ab
#                           (32 MiB each: with the checkout, 61 MiB does not fit one call): .aa alone in a first call,
#                           .ab beside fa4rest.tar.xz in the next; scripts/device_env.sh joins and extracts them into
#                           .device/fa4x, which stays on a warm machine between calls
#   .device/fa4rest.tar.xz  flash-attn-4 4.0.0b36 and the rest of FlashAttention-4's stack, flash-qla 0.1.3 (~8 MiB)
#   .device/tf.tar.xz       transformers 5.24.0 alone (~5 MiB; the machine has 5.17, which lacks bailing_hybrid, and
#                           the huggingface-hub 1.33 / tokenizers 0.23.2 / safetensors 0.8 it needs: huggingface-hub
#                           2.x would need httpx2, which the machine lacks)
#   .device/liger.tar.xz    liger-kernel 0.8.5 (< 1 MiB): TRL's `use_liger_kernel` for the TRL baseline at its best
#                           (scripts/device_env.sh puts it on PYTHONPATH when carried)
#
# On the machine: tar -C .device/fa4x -xJf .device/fa4libs.tar.xz (call 1), then in every call
#   S=$(mktemp -d) && tar -C "$S" -xJf .device/site.tar.xz && export PYTHONPATH="$PWD:$S:$PWD/.device/fa4x:$PWD/.device/fa4x/nvidia_cutlass_dsl/dsl_packages"
# (extract fa4rest.tar.xz into .device/fa4x once; tf.tar.xz into a folder placed before "$S" on PYTHONPATH).
# Usage: bash scripts/device_extras.sh [--force]   (from anywhere inside the checkout; ~8 minutes on 2 cores)
# The versions are the ones the 2026-12-02 H200 runs used (BENCHMARKS.md).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
out="$root/.device"
mkdir -p "$out"
grep -qxF '/.device/' "$root/.git/info/exclude" 2>/dev/null || echo '/.device/' >> "$root/.git/info/exclude"
declare -A archive=([libs]=fa4libs.tar.xz [rest]=fa4rest.tar.xz [tf]=tf.tar.xz [liger]=liger.tar.xz)
parts=()
for part in libs rest tf liger; do
  if [ -f "$out/${archive[$part]}" ] && [ "${1:-}" != "--force" ]; then
    echo "reusing .device/${archive[$part]}; pass --force to rebuild"
  else
    parts+=("$part")
  fi
done
[ ${#parts[@]} -gt 0 ] || exit 0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
get() { python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp/$1" "${@:2}"; }
declare -A wheels=(
  [libs]="nvidia-cutlass-dsl-libs-cu13==4.8.1"
  [rest]="flash-attn-4==4.0.0b36 flash-qla==0.1.3 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
          nvidia-cutlass-dsl-libs-core==4.8.1 quack-kernels==0.6.5 einops==0.8.2 cuda-bindings==13.5.0
          cuda-pathfinder==1.9.1"
  [tf]="transformers==5.24.0"
  [liger]="liger-kernel==0.8.5")
for part in "${parts[@]}"; do
  # shellcheck disable=SC2086  # the list splits into one requirement a word
  get "$part" ${wheels[$part]}
  mkdir "$tmp/$part.site"
  for wheel in "$tmp/$part"/*.whl; do python3 -m zipfile -e "$wheel" "$tmp/$part.site"; done
done
pack() { tar -C "$tmp/$1.site" -cf - . | xz -9 -T0 > "$out/$2.part" && mv "$out/$2.part" "$out/$2"; }
for part in "${parts[@]}"; do pack "$part" "${archive[$part]}" & done
wait
rm -f "$out"/fa4libs.tar.xz.a?
split -b 32M "$out/fa4libs.tar.xz" "$out/fa4libs.tar.xz."   # the halves the device tool carries
ls -la "$out"
