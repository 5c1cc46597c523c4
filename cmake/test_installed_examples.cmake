# CTest driver: install Trellis into a scratch prefix and move it elsewhere (the install must be relocatable), run
# the installed command line, configure and build examples/ against the moved package with find_package(Trellis),
# run each example, and check that the package refuses a LibTorch of another release. Inputs: BUILD_DIR,
# SOURCE_DIR, TORCH_DIR, GENERATOR, CUDA_COMPILER (may be empty), LAUNCHER (may be empty).
set(installed "${BUILD_DIR}/examples-install")
set(prefix "${BUILD_DIR}/examples-install-moved")
set(ex_build "${BUILD_DIR}/examples-build")
function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGV}")
  endif()
endfunction()
file(REMOVE_RECURSE "${installed}" "${prefix}" "${ex_build}")
run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${installed}")
file(RENAME "${installed}" "${prefix}")
file(MAKE_DIRECTORY "${ex_build}")

# The installed command line starts from the moved prefix with no environment set up for it (LD_LIBRARY_PATH is
# left as the caller has it: empty here and in CI; on the GPU machine it names the unpacked Boost only).
execute_process(COMMAND "${prefix}/bin/trellis" --version
                RESULT_VARIABLE rc OUTPUT_VARIABLE version ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT version MATCHES "^trellis [0-9]+\\.[0-9]+\\.[0-9]+ \\(LibTorch 2\\.11\\.0")
  message(FATAL_ERROR "installed trellis --version failed (${rc}): ${version}${err}")
endif()
run("${prefix}/bin/trellis" crf train --train "${SOURCE_DIR}/data/ud-en-ewt-sample/train.txt"
    --model "${ex_build}/cli.crf" --max-iter 2)
foreach(header version.h crf/crf_tagger.h)
  if(NOT EXISTS "${prefix}/include/trellis/${header}")
    message(FATAL_ERROR "trellis/${header} is not installed")
  endif()
endforeach()

set(args -S "${SOURCE_DIR}/examples" -B "${ex_build}" -G "${GENERATOR}" "-DCMAKE_PREFIX_PATH=${prefix}"
         "-DTorch_DIR=${TORCH_DIR}")
if(CUDA_COMPILER)
  list(APPEND args "-DCMAKE_CUDA_COMPILER=${CUDA_COMPILER}")
endif()
if(LAUNCHER)
  list(APPEND args "-DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER}")
endif()
run(${CMAKE_COMMAND} ${args})
run(${CMAKE_COMMAND} --build "${ex_build}")
run("${ex_build}/hmm_weather")
run("${ex_build}/hmm_file" "${ex_build}/example_model.h5")
run("${ex_build}/crf_tagger" "${SOURCE_DIR}/data/ud-en-ewt-sample/train.txt" "${ex_build}/pos.crf")
run("${ex_build}/llm_head")

# A LibTorch of another release is refused by the package, with a message naming Trellis.
set(fake "${ex_build}/fake-torch")
file(WRITE "${fake}/TorchConfig.cmake" "set(Torch_FOUND TRUE)\n")
file(WRITE "${fake}/TorchConfigVersion.cmake"
     "set(PACKAGE_VERSION 2.12.0)\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n")
file(WRITE "${ex_build}/other-torch/CMakeLists.txt"
     "cmake_minimum_required(VERSION 3.25)\nproject(other_torch LANGUAGES NONE)\nfind_package(Trellis REQUIRED)\n")
execute_process(COMMAND ${CMAKE_COMMAND} -S "${ex_build}/other-torch" -B "${ex_build}/other-torch/build"
                        "-DCMAKE_PREFIX_PATH=${prefix}" "-DTorch_DIR=${fake}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "Trellis [0-9.]+ was built against LibTorch 2\\.11\\.0, but the LibTorch found is[ \n]+2\\.12\\.0")
  message(FATAL_ERROR "a LibTorch of another release was not refused (${rc}): ${out}${err}")
endif()
message(STATUS "installed package: moved, CLI and examples run, other LibTorch refused")
