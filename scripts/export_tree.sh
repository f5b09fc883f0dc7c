#!/usr/bin/env bash
# On the development machine: git ref REF's sources as an overlay for `scripts/gpu_check.sh trees`,
# which builds and times them against this working tree on the device. trees/LABEL/ gets each file
# under src/ and tests/ that differs between REF and the working tree, as REF has it, and
# trees/LABEL/.deleted the paths REF lacks. trees/ is ignored by git: pass `carry: ["trees"]` to the
# device run. Why overlays, not whole trees: the device's transfer is capped near the tracked tree's size.
#   scripts/export_tree.sh main~1 before && scripts/export_tree.sh wip/attn-load-order attn
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:?usage: scripts/export_tree.sh REF [LABEL]}
label=${2:-$(printf '%s' "$ref" | tr -c 'A-Za-z0-9._-' '-')}
git rev-parse --verify -q "$ref^{commit}" > /dev/null || { echo "export_tree: '$ref' is not a commit" >&2; exit 2; }
out=trees/$label
rm -rf "$out" && mkdir -p "$out" && : > "$out/.deleted"
n=0
while IFS= read -r -d '' f; do
  if git cat-file -e "$ref:$f" 2> /dev/null; then
    mkdir -p "$out/$(dirname "$f")" && git show "$ref:$f" > "$out/$f"
  else
    printf '%s\n' "$f" >> "$out/.deleted"
  fi
  n=$((n + 1))
done < <(git diff --name-only -z "$ref" -- src tests)
echo "trees/$label: $n file(s) differ from the working tree ($(wc -l < "$out/.deleted") absent in $ref)"
