#!/usr/bin/env bash
# On the development machine: timing-only probes of the CUDA decode step as source overlays in
# trees/LABEL/ (the form scripts/export_tree.sh writes), for `scripts/gpu_check.sh trees` (carry
# trees). Each probe breaks what it removes on purpose, so its builds are timed, never checked.
#   nowait  every kernel's programmatic wait a no-op: each runs on whatever its inputs hold when it
#           starts, the bound of removing the step's dependencies (docs/cuda.md, "The bounds")
#   nolo    the tensor-core decode attention without Q's lo part in the scores and with P in one
#           BF16 part: half its MMAs, whether its MMA chain is what holds G = 8 at 4096 keys
#           (docs/cuda.md, plan item 2)
#   scripts/probe_overlays.sh nowait nolo && scripts/gpu_check.sh trees   (the latter on the device)
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: scripts/probe_overlays.sh PROBE... (nowait, nolo)" >&2; exit 2; }
# FILE SED-SCRIPT LABEL: FILE through the script into trees/LABEL/FILE, which must then differ.
overlay() {
  mkdir -p "trees/$3/$(dirname "$1")" && : > "trees/$3/.deleted"
  sed "$2" "$1" > "trees/$3/$1"
  ! cmp -s "$1" "trees/$3/$1" || { echo "probe_overlays: $3: $1 unchanged (the source moved; update this script)" >&2; exit 1; }
}
for p in "$@"; do
  rm -rf "trees/$p"
  case $p in
    nowait) overlay src/cuda/dependent_launch.cuh 's|{ asm volatile("griddepcontrol.wait;" ::: "memory"); }|{}|' nowait ;;
    nolo)
      overlay src/cuda/attention_prefill.cu '/^      mma_bf16(sl, a, ql\[kk\]\[0\], ql\[kk\]\[1\]);$/d' nolo
      overlay src/cuda/cuda_backend.cpp 's/cuda::attention_prefill(att_, q_, append, pos_, T, H, Hkv, Dh, true,/cuda::attention_prefill(att_, q_, append, pos_, T, H, Hkv, Dh, false,/' nolo ;;
    *) echo "probe_overlays: unknown probe '$p' (nowait, nolo)" >&2; exit 2 ;;
  esac
  echo "trees/$p: $(cd "trees/$p" && find . -type f ! -name .deleted | sed 's|^\./||' | tr '\n' ' ')"
done
