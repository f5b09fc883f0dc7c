#!/usr/bin/env bash
# One command on a fresh machine: install, build, and run the whole test suite, then run it
# again under AddressSanitizer + UndefinedBehaviorSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh build
(cd build && ctest --output-on-failure -j2 --timeout 600)
if [ "${TIERMOE_SKIP_SANITIZERS:-0}" != 1 ]; then
  bash scripts/build.sh build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTIERMOE_SANITIZE=ON
  (cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j2 --timeout 900)
fi
