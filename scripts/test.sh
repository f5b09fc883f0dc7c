#!/usr/bin/env bash
# One command on a fresh machine: install, build, and run the whole test suite, then run it
# again under AddressSanitizer + UndefinedBehaviorSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh build
(cd build && ctest --output-on-failure -j2 --timeout 600)
# The server through the official `openai` npm client (tests/client; npm registry access needed).
(cd tests/client && { if [ -f package-lock.json ]; then npm ci --no-audit --no-fund; else npm install --no-audit --no-fund; fi; } >/dev/null \
  && TIERMOE_BIN="$PWD/../../build/tiermoe" timeout 600 node --test --test-concurrency=1)
if [ "${TIERMOE_SKIP_SANITIZERS:-0}" != 1 ]; then
  # CUDA sources are compiled (and checked) by the first build; the sanitizers are host-only.
  bash scripts/build.sh build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTIERMOE_SANITIZE=ON -DTIERMOE_CUDA=OFF
  (cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j2 --timeout 900)
fi
