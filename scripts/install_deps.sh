#!/usr/bin/env bash
# Installs what tiermoe needs to build and test on Debian 12, from Debian packages only.
set -euo pipefail
pkgs=(build-essential cmake pkg-config nlohmann-json3-dev libpcre2-dev libicu-dev libcli11-dev
      libgtest-dev libgmock-dev libbenchmark-dev python3
      libcpp-httplib-dev)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
# The server tests run the `openai` npm client (tests/client): Node.js and npm, from Debian
# unless a Node.js with npm is already installed.
command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
