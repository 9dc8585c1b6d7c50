#!/usr/bin/env bash
# Installs the Debian packages the build needs (Debian 12). Safe to run again.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git python3 python3-pip
  nlohmann-json3-dev libfmt-dev libcli11-dev libgtest-dev libgmock-dev libbenchmark-dev
  libpcre2-dev libutf8proc-dev libcpp-httplib-dev libopenblas-dev libxxhash-dev
)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}"
fi
