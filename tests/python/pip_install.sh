#!/usr/bin/env bash
# `pip install .` of the Python package into a scratch venv, then the installed package used from outside the source
# tree: import, a CRF's log-likelihood, gradient and Viterbi paths against pytorch-crf's, the libraries' RUNPATH
# ($ORIGIN alone), and the refusal of another torch release at import.
#   tests/python/pip_install.sh SOURCE_DIR WORK_DIR PROJECT_PYTHON [pip install options]
# TRELLIS_PIP_BUILD_DIR: where scikit-build-core builds (emptied first, removed once the install succeeded; default: a
# temporary folder of its own).
# The scratch venv sees the project venv's packages (torch among them) through links in its site-packages, as if
# installed there, so that nothing large is downloaded; pip fetches scikit-build-core for its isolated build.
set -euo pipefail
source_dir=$1 work=$2 project_python=$3
shift 3
rm -rf "$work"
mkdir -p "$work"
base_python=$("$project_python" -c 'import sys; print(sys._base_executable)')
"$base_python" -m venv "$work/venv"
python="$work/venv/bin/python"
project_site=$("$project_python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
site=$("$python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
for entry in "$project_site"/*; do
  name=$(basename "$entry")
  case "$name" in
    trellis | trellis-* | __pycache__) ;;
    *) [ -e "$site/$name" ] || ln -s "$entry" "$site/" ;;  # the venv's own pip and setuptools stay
  esac
done

# A CUDA torch's CMake files need nvcc, which the machine has under /usr/local/cuda but not always on PATH (as build.sh).
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
if [ -n "${TRELLIS_PIP_BUILD_DIR:-}" ]; then
  rm -rf "$TRELLIS_PIP_BUILD_DIR"  # a stale CMake cache keeps old paths
  set -- --config-settings=build-dir="$TRELLIS_PIP_BUILD_DIR" "$@"
fi
start=$(date +%s)
"$python" -m pip install --no-input --disable-pip-version-check -q "$@" "$source_dir"
echo "pip install took $(($(date +%s) - start)) s"
[ -z "${TRELLIS_PIP_BUILD_DIR:-}" ] || rm -rf "$TRELLIS_PIP_BUILD_DIR"  # a second build tree's worth of disk

cd "$work"  # away from the source tree's bindings/python/
"$python" - "$site" <<'PY'
import sys
from pathlib import Path

import torch
import torchcrf

import trellis

site = Path(sys.argv[1])
assert Path(trellis.__file__).parent == site / "trellis", trellis.__file__
print("trellis", trellis.__version__, "from", Path(trellis.__file__).parent, "with torch", torch.__version__)
torch.manual_seed(0)
crf, reference = trellis.CRF(5, batch_first=True), torchcrf.CRF(5, batch_first=True)
reference.load_state_dict(crf.state_dict())
emissions = torch.randn(3, 7, 5, requires_grad=True)
tags = torch.randint(0, 5, (3, 7))
mask = torch.arange(7)[None, :] < torch.tensor([7, 2, 5])[:, None]
llh = crf(emissions, tags, mask)
llh.backward()
expected = reference(emissions, tags, mask)
torch.testing.assert_close(llh, expected)
torch.testing.assert_close(emissions.grad, torch.autograd.grad(expected, emissions)[0])
assert crf.decode(emissions, mask) == reference.decode(emissions, mask)
print("CRF log-likelihood", llh.item(), "paths", crf.decode(emissions, mask))
PY

for library in "$site"/trellis/libtrellis.so "$site"/trellis/libtrellis_ops.so; do
  runpath=$(readelf -d "$library" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')
  [ "$runpath" = '$ORIGIN' ] || { echo "RUNPATH of $library is '$runpath', not \$ORIGIN" >&2; exit 1; }
done

if message=$("$python" -c 'import torch; torch.__version__ = "2.10.0"; import trellis' 2>&1); then
  echo "trellis imported under another torch release" >&2
  exit 1
fi
grep -q "ImportError: trellis was built against PyTorch [0-9.]* and cannot run with the PyTorch 2.10.0" <<<"$message" || {
  echo "unexpected error for another torch release: $message" >&2
  exit 1
}
echo "another torch release refused: $(tail -1 <<<"$message")"
