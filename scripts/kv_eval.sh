#!/usr/bin/env bash
# Reproduces the KV-cache quality table of docs/kv_codecs.md with one command: every preset
# (and the archive-early / archive-only / offline-profile variants) on tinymix-code at 4096
# context: perplexity, KL and top-1 agreement against the BF16 cache, bits per value, KV bytes,
# and needle retrieval. Runs JOBS evaluations at once, THREADS threads each.
#   scripts/kv_eval.sh                 # everything, results in kv_eval_out/
#   WINDOWS=2 NEEDLE=0 scripts/kv_eval.sh
# Then: python3 scripts/kv_table.py kv_eval_out  (table.md and chart.svg)
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/tiermoe}
MODEL=${MODEL:-models/tinymix-code}
TEXT=${TEXT:-$MODEL/heldout.txt}
OUT=${OUT:-kv_eval_out}
WINDOWS=${WINDOWS:-4}
NEEDLE=${NEEDLE:-1}
THREADS=${THREADS:-2}
JOBS=${JOBS:-$(( $(nproc) / THREADS ))}
NEEDLE_TRIALS=${NEEDLE_TRIALS:-9}
CONFIGS=${CONFIGS:-"bf16 fp8 kivi4 kivi2 hadamard3 hadamard2 oskvp rvq-tiers default default@post-rope default@offline default@M1024 default@archive-only rvq-tiers@M1024 rvq-tiers@archive-only"}
NEEDLE_CONFIGS=${NEEDLE_CONFIGS:-$CONFIGS}
mkdir -p "$OUT"
# The commit of the sources when the run starts (the binary should be built from them).
COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (+local changes)')"
[ -f "$MODEL/model-00001-of-00007.safetensors" ] || scripts/unpack_model.sh

# name@variant -> a --kv-config file
config_args() {
  local name=${1%@*} variant=${1#*@}
  [ "$variant" = "$1" ] && { echo "--kv $name"; return; }
  local f="$OUT/$1.json"
  case $variant in
    M1024) echo "{\"preset\": \"$name\", \"name\": \"$1\", \"middle\": 1024}" > "$f" ;;
    archive-only) echo "{\"preset\": \"$name\", \"name\": \"$1\", \"middle\": 128}" > "$f" ;;
    post-rope) echo "{\"preset\": \"$name\", \"name\": \"$1\", \"k\": {\"pre_rope\": false}}" > "$f" ;;
    offline) echo "--kv $name --kv-profile $OUT/$name.prof"; return ;;
    *) echo "{\"preset\": \"$name\", \"name\": \"$1\", $variant}" > "$f" ;;
  esac
  echo "--kv-config $f"
}

# Offline profiles: fitted on a stretch of held-out text far from the evaluated windows.
for c in $CONFIGS; do
  case $c in *@offline)
    n=${c%@*}
    [ -f "$OUT/$n.prof" ] || "$BIN" calibrate --model "$MODEL" --kv "$n" --file "$TEXT" --offset 300000 --tokens 4096 \
      --threads "$THREADS" -o "$OUT/$n.prof" 2>/dev/null ;;
  esac
done

jobs_list() {
  for c in $CONFIGS; do
    local a; a=$(config_args "$c")
    echo "$BIN ppl --model $MODEL --file $TEXT --ctx 4096 --windows $WINDOWS --ref-kv bf16 --threads $THREADS --json $a > $OUT/$c.ppl.json 2> $OUT/$c.ppl.err"
  done
  if [ "$NEEDLE" = 1 ]; then
    for c in $NEEDLE_CONFIGS; do
      local a; a=$(config_args "$c")
      echo "$BIN needle --model $MODEL --trials $NEEDLE_TRIALS --threads $THREADS --json $a > $OUT/$c.needle.json 2> $OUT/$c.needle.err"
    done
  fi
}
jobs_list | xargs -P "$JOBS" -I{} sh -c '{}'
{
  echo "machine: $(uname -m), $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))"
  echo "commit: $COMMIT"
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "command: WINDOWS=$WINDOWS NEEDLE=$NEEDLE NEEDLE_TRIALS=$NEEDLE_TRIALS CONFIGS=\"$CONFIGS\" NEEDLE_CONFIGS=\"$NEEDLE_CONFIGS\" scripts/kv_eval.sh"
} > "$OUT/meta.txt"
python3 scripts/kv_table.py "$OUT"
