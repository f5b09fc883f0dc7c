#!/usr/bin/env bash
# One command on a fresh machine: install, build, and generate code with the embedded model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh build
prompt="${*:-import numpy as np

def softmax(x, axis=-1):
    }"
./build/tiermoe generate --model models/tinymix-code -p "$prompt" --max-tokens 200 --temperature 0.7 --seed 1
