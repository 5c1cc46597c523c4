# CTest driver: install Trellis into a scratch prefix, configure and build examples/ against that installed package
# with find_package(Trellis), then run each example. Inputs: BUILD_DIR, SOURCE_DIR, TORCH_DIR, GENERATOR,
# CUDA_COMPILER (may be empty), LAUNCHER (may be empty).
set(prefix "${BUILD_DIR}/examples-install")
set(ex_build "${BUILD_DIR}/examples-build")
function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGV}")
  endif()
endfunction()
file(REMOVE_RECURSE "${prefix}")
run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${prefix}")
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
