#!/usr/bin/env bash
# The cpack packages install and run outside the build tree. Makes the .tar.gz and the .deb from the build tree;
# extracts the .tar.gz into a fresh folder, runs `trellis --version` from it and builds and runs examples/hmm_weather.cpp
# against it with find_package(Trellis); checks the .deb's control fields and contents (the same files as the
# archive), unpacks it with `dpkg -x` into a scratch root (no dpkg -i: other tests run beside this one) and trains and
# tags with the command from there; and checks that every library the packaged binaries need directly is found in the
# package itself, in its RUNPATH (LibTorch), or in a Debian package the .deb depends on.
# Usage: install_package_test.sh BUILD_DIR SOURCE_DIR TORCH_DIR GENERATOR VERSION TORCH_VERSION DEB [CUDA_COMPILER
#        [LAUNCHER]], DEB being ON where CMake made a .deb generator (TRELLIS_PACKAGE_DEB, cmake/TrellisPackaging.cmake).
set -euo pipefail
build=$1 source=$2 torch_dir=$3 generator=$4 version=$5 torch_version=$6 with_deb=$7 cuda_compiler=${8:-} launcher=${9:-}
work="$build/package-test"
rm -rf "$work"
mkdir -p "$work"
fail() { echo "FAIL: $*" >&2; exit 1; }
# No environment from the caller but LD_LIBRARY_PATH, as the caller has it (as for the installed examples): empty here
# and in CI; on the GPU machine it names the Boost unpacked there, which no package provides (and no .deb is made).
clean() { env -i PATH=/usr/bin:/bin HOME="$work" ${LD_LIBRARY_PATH:+LD_LIBRARY_PATH="$LD_LIBRARY_PATH"} "$@"; }

cpack --config "$build/CPackConfig.cmake" -B "$work/out" >"$work/cpack.log" 2>&1 || { cat "$work/cpack.log"; fail cpack; }
tgz=$(ls "$work"/out/trellis-"$version"-*.tar.gz)
if [ "$with_deb" = ON ]; then deb=$(ls "$work"/out/trellis_"$version"_*.deb); fi

check_version() {  # trellis --version of the given binary
  local out
  out=$(clean "$1" --version) || fail "$1 --version exited with $?"
  [[ $out =~ ^trellis\ $version\ \(LibTorch\ $torch_version ]] || fail "$1 --version printed: $out"
}

# --- the archive: a fresh folder, the command and an example built against it ---
mkdir "$work/tgz"
tar -xzf "$tgz" -C "$work/tgz"
prefix=$(echo "$work"/tgz/trellis-"$version"-*)
[ -d "$prefix" ] || fail "no top folder in $tgz"
check_version "$prefix/bin/trellis"
mkdir "$work/example"
cat >"$work/example/CMakeLists.txt" <<EOF
cmake_minimum_required(VERSION 3.25)
project(packaged_example LANGUAGES CXX)
set(CMAKE_CXX_STANDARD 17)
find_package(Trellis $version EXACT REQUIRED)
add_executable(hmm_weather "$source/examples/hmm_weather.cpp")
target_link_libraries(hmm_weather PRIVATE Trellis::trellis)
EOF
args=(-S "$work/example" -B "$work/example/build" -G "$generator" "-DCMAKE_PREFIX_PATH=$prefix" "-DTorch_DIR=$torch_dir")
[ -n "$cuda_compiler" ] && args+=("-DCMAKE_CUDA_COMPILER=$cuda_compiler")
[ -n "$launcher" ] && args+=("-DCMAKE_CXX_COMPILER_LAUNCHER=$launcher")
cmake "${args[@]}" >"$work/example.log" 2>&1 || { cat "$work/example.log"; fail "configuring the example"; }
cmake --build "$work/example/build" >>"$work/example.log" 2>&1 || { cat "$work/example.log"; fail "building the example"; }
clean "$work/example/build/hmm_weather" >"$work/example/out.txt" || fail "hmm_weather exited with $?"
grep -q . "$work/example/out.txt" || fail "hmm_weather printed nothing"

if [ "$with_deb" != ON ]; then
  echo "package: $(basename "$tgz") installs and runs; no .deb on this machine (cmake/TrellisPackaging.cmake)"
  exit 0
fi

# --- the .deb: control fields and contents ---
info=$(dpkg-deb --info "$deb")
for field in "Package: trellis" "Version: $version" "Maintainer: " "Description: " "Section: science"; do
  grep -q "^ $field" <<<"$info" || fail ".deb control has no '$field': $info"
done
depends=$(dpkg-deb --field "$deb" Depends)
depends_on() {  # depends_on GLOB: a package of Depends matches GLOB
  local name
  for name in $(tr ',' '\n' <<<"$depends" | awk '{print $1}'); do
    # shellcheck disable=SC2053
    [[ $name == $1 ]] && return 0
  done
  return 1
}
# libgomp.so.1 is not among them: LibTorch's folder has it (lib/CMakeLists.txt: one OpenMP runtime in the process).
for package in 'libboost-program-options*' 'libhdf5-[0-9]*' 'libhdf5-cpp-*' libstdc++6 libc6; do
  depends_on "$package" || fail ".deb Depends lacks $package: $depends"
done
dpkg-deb --contents "$deb" | awk '$1 !~ /^d/ {print $6}' | sed 's|^\./usr/||' | sort >"$work/deb-files"
(cd "$prefix" && find . ! -type d | sed 's|^\./||' | sort) >"$work/tgz-files"
diff "$work/tgz-files" "$work/deb-files" || fail ".deb and .tar.gz hold different files (< archive, > .deb)"
for file in bin/trellis lib/libtrellis.so.$version lib/libtrellis_ops.so include/trellis/version.h \
            include/trellis/crf/crf_tagger.h lib/cmake/Trellis/TrellisConfig.cmake share/doc/trellis/LICENSE; do
  grep -qx "$file" "$work/deb-files" || fail ".deb lacks /usr/$file"
done

# --- the .deb unpacked into a scratch root: the command trains and tags from there, on its own library ---
root="$work/root"
dpkg -x "$deb" "$root"
check_version "$root/usr/bin/trellis"
# The output taken whole, then matched: under pipefail, `ldd | grep -q` fails when grep's early exit breaks ldd's pipe.
linked=$(clean ldd "$root/usr/bin/trellis")
grep -qF "libtrellis.so.0 => $root/usr/bin/../lib/libtrellis.so.0" <<<"$linked" ||
  fail "the unpacked command does not load the unpacked library: $(grep trellis <<<"$linked")"
data="$source/data/ud-en-ewt-sample"
clean "$root/usr/bin/trellis" crf train --train "$data/train.txt" --model "$work/pos.crf" --max-iter 2 >/dev/null
head -40 "$data/dev.txt" | clean "$root/usr/bin/trellis" crf tag --model "$work/pos.crf" - >"$work/tagged.txt"
[ "$(grep -c . "$work/tagged.txt")" -gt 0 ] || fail "tagging from the unpacked .deb gave no output"

# --- each library a packaged binary needs directly: in the package, in its RUNPATH, or from a Depends package ---
owner() {  # the Debian package owning a file, trying its /usr-merged aliases
  local real candidate owners
  real=$(realpath "$1")
  for candidate in "$1" "$real" "${real#/usr}" "/usr$real"; do
    owners=$(dpkg-query -S "$candidate" 2>/dev/null) && { head -1 <<<"$owners" | cut -d: -f1; return 0; }
  done
  return 1
}
for binary in "$root/usr/bin/trellis" "$root"/usr/lib/libtrellis.so."$version" "$root/usr/lib/libtrellis_ops.so"; do
  runpath=$(readelf -d "$binary" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')
  [[ $runpath == *"$build"* ]] && fail "$binary has the build tree in its RUNPATH: $runpath"
  ldd_out=$(clean ldd "$binary")
  for needed in $(readelf -d "$binary" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
    [[ $needed == ld-linux* ]] && continue
    path=$(awk -v n="$needed" '$1 == n && $2 == "=>" {print $3}' <<<"$ldd_out")
    [ -n "$path" ] && [ "$path" != "not" ] || fail "$binary: $needed not found"
    [[ $path == "$root"/* ]] && continue
    dir=$(dirname "$path")
    if [[ ":$runpath:" == *":$dir:"* ]]; then continue; fi
    package=$(owner "$path") || fail "$binary: $needed comes from $path, which no Debian package owns and no RUNPATH names"
    depends_on "$package" || fail "$binary: $needed is in $package, not in Depends: $depends"
  done
done
echo "packages: $(basename "$tgz") and $(basename "$deb") (Depends: $depends) install and run"
