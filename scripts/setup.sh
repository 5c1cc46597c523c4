#!/usr/bin/env bash
# One-time (idempotent) set-up of everything Trellis needs on a fresh Debian machine:
# system packages, a project-local venv with LibTorch 2.11.0, then CMake configure.
# Re-running when everything is present takes seconds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# libgloo-dev: the Gloo headers LibTorch's ProcessGroupGloo.hpp includes (the wheel links Gloo but ships no headers),
# for the data-parallel commands' CPU process groups (lib/src/distributed/distributed_gloo.cpp).
debs=(cmake ninja-build ccache g++ libboost-program-options-dev libhdf5-dev libgtest-dev python3-venv libgloo-dev)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[setup] installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

venv="$root/.venv"
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating venv $venv"
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.11.0") else 1)' 2>/dev/null; then
  echo "[setup] installing torch==2.11.0 into $venv (large download, once)"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q torch==2.11.0 numpy
fi
# hmmlearn and h5py: the side-by-side HMM agreement test (tests/, tests/hmmlearn_compare.py).
if ! "$venv/bin/python" -c 'import hmmlearn, h5py' 2>/dev/null; then
  echo "[setup] installing hmmlearn==0.3.3 and h5py into $venv"
  "$venv/bin/python" -m pip install -q hmmlearn==0.3.3 h5py
fi
# The Python package's tests (tests/python, run by CTest): pytest, and the libraries it is checked against
# (pytorch-crf's CRF, torch-struct's LinearChainCRF); scikit-build-core builds the package (pyproject.toml).
if ! "$venv/bin/python" -c 'import pytest, torchcrf, torch_struct, scikit_build_core' 2>/dev/null; then
  echo "[setup] installing pytest, pytorch-crf, torch-struct and scikit-build-core into $venv"
  "$venv/bin/python" -m pip install -q pytest==9.2.0 pytorch-crf==0.7.2 torch-struct==0.5 scikit-build-core==1.1.2
fi
