#!/usr/bin/env bash
# End-to-end tests of `vavilov serve` on loopback: the official openai client, raw HTTP, concurrency, prefix cache.
# Usage: run_server_tests.sh VAVILOV_BINARY [unittest names, e.g. test_http.Auth]
set -euo pipefail
binary=$(realpath "$1")
shift
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
pip=(python3 -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" -r "$root/tools/requirements-server.txt" 2>/dev/null ||
  "${pip[@]}" --break-system-packages -r "$root/tools/requirements-server.txt"
cd "$here"
if [ $# -eq 0 ]; then set -- test_openai test_http test_load test_prefix_device; fi
VAVILOV_BINARY=$binary python3 -m unittest -v "$@"
