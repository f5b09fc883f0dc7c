#!/usr/bin/env bash
# The embedded model's shards and held-out text are committed xz-compressed (the repository must
# stay small enough to travel); this restores the plain files next to them when missing or stale.
set -euo pipefail
cd "$(dirname "$0")/.."
for xzf in models/*/*.xz; do
  out="${xzf%.xz}"
  if [ ! -f "$out" ] || [ "$xzf" -nt "$out" ]; then
    xz -dc "$xzf" > "$out.tmp" && mv "$out.tmp" "$out"
  fi
done
