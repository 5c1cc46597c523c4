#!/usr/bin/env bash
# Applies .clang-format (120 columns; include order kept as written) to the C++ and CUDA sources in place:
# lib/ cuda/ apps/ bench/ bindings/ examples/ and the test sources tests/*.cpp, tests/*.h (tests/fuzz is left as it is).
# Usage: scripts/dev/format.sh [--check] [FILE...]   (--check: change nothing, list the files that would change, fail
# if any; FILEs: only these, else every source above)
# CLANG_FORMAT names another clang-format (default: clang-format, else the newest clang-format-NN on PATH).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
tool="${CLANG_FORMAT:-}"
if [ -z "$tool" ]; then
  tool="$(command -v clang-format || true)"
  [ -n "$tool" ] || tool="$(compgen -c clang-format- | grep -E '^clang-format-[0-9]+$' | sort -t- -k3 -n | tail -1 || true)"
fi
[ -n "$tool" ] || { echo "format.sh: no clang-format found (Debian: apt-get install clang-format)" >&2; exit 1; }
mapfile -t files < <(git ls-files -- 'lib/*.h' 'lib/*.cpp' 'cuda/*.h' 'cuda/*.cuh' 'cuda/*.cu' 'apps/*.h' 'apps/*.cpp' \
  'bench/*.h' 'bench/*.cpp' 'bindings/*.h' 'bindings/*.cpp' 'examples/*.h' 'examples/*.cpp' 'tests/*.cpp' 'tests/*.h' |
  grep -v '^tests/fuzz/')
check=0
if [ "${1:-}" = "--check" ]; then check=1; shift; fi
if [ $# -gt 0 ]; then files=("$@"); fi
if [ "$check" = 1 ]; then
  changed=0
  for f in "${files[@]}"; do
    if ! "$tool" --style=file "$f" | cmp -s - "$f"; then echo "$f"; changed=1; fi
  done
  exit "$changed"
fi
"$tool" --style=file -i "${files[@]}"
echo "formatted ${#files[@]} files with $("$tool" --version)"
