#!/usr/bin/env bash
# Download the .deb files that scripts/gpu_check.sh unpacks on the GPU machine (which has no network and neither
# Boost.Program_options nor Gloo's headers, which the Gloo process group of trellis/distributed/distributed.h compiles
# against). The folder is git-ignored and carried with the run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p "$root/.gpu-debs" && cd "$root/.gpu-debs"
apt-get download libboost1.74-dev libboost-program-options1.74-dev libboost-program-options1.74.0 \
  libboost-program-options-dev libgloo-dev
