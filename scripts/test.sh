#!/usr/bin/env bash
# Set up everything (first run only), build, and run the whole test suite through CTest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/build.sh"
ctest --test-dir "${TRELLIS_BUILD_DIR:-$root/build}" --output-on-failure -j "$(nproc)"
