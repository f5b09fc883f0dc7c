#!/usr/bin/env bash
# Installs dependencies, unpacks the embedded model and builds into build/ (or $1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/unpack_model.sh
dir="${1:-build}"; shift || true
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$dir" -j"$(nproc)"
