# Binary packages of the install tree (`cpack --config build/CPackConfig.cmake`): a relocatable .tar.gz, and a .deb
# that installs under /usr. Both hold the command line, the library and the operator library, the public headers and
# the CMake package. LibTorch is not packaged (no Debian package carries the release Trellis needs): the installed
# files find it through their RUNPATH, TRELLIS_INSTALL_TORCH_RPATH (lib/CMakeLists.txt; by default the torch/lib of
# the venv the build used, and the CUDA runtime of its wheel), or through LD_LIBRARY_PATH, which is searched first.
set(CPACK_PACKAGE_NAME trellis)
set(CPACK_PACKAGE_VENDOR "The Trellis authors")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "Structured prediction on LibTorch: linear-chain CRFs, HMMs, semiring kernels, a fused LLM output head")
string(CONCAT CPACK_PACKAGE_DESCRIPTION
    "Trellis is a C++/CUDA toolkit for structured prediction built on LibTorch ${TRELLIS_TORCH_VERSION}: "
    "linear-chain CRFs and HMMs (partition functions, marginals, Viterbi, training), semiring matrix products, "
    "and a linear cross-entropy head that never forms the logits. The package holds the trellis command line, "
    "libtrellis with its headers and CMake package (find_package(Trellis)), and libtrellis_ops for PyTorch. "
    "It needs LibTorch ${TRELLIS_TORCH_VERSION} (pip install torch==${TRELLIS_TORCH_VERSION}), found where the "
    "package was built or through LD_LIBRARY_PATH.")
set(CPACK_RESOURCE_FILE_LICENSE "${PROJECT_SOURCE_DIR}/LICENSE")
set(CPACK_PACKAGE_CHECKSUM SHA256)
set(CPACK_GENERATOR TGZ)
set(TRELLIS_PACKAGE_MAINTAINER "The Trellis authors <trellis@example.org>" CACHE STRING "Maintainer field of the .deb")

# A .deb where the machine is Debian's and its Boost and HDF5 come from Debian packages (on the GPU machine Boost is
# unpacked from .deb files without dpkg: no package owns it, so no Depends could name it).
find_program(TRELLIS_DPKG_DEB dpkg-deb)
find_program(TRELLIS_DPKG_QUERY dpkg-query)
find_program(TRELLIS_READELF readelf)
find_program(TRELLIS_LDCONFIG ldconfig PATHS /sbin /usr/sbin)
set(TRELLIS_PACKAGE_DEB OFF)
if(TRELLIS_DPKG_DEB AND TRELLIS_DPKG_QUERY AND TRELLIS_READELF AND TRELLIS_LDCONFIG)
  set(TRELLIS_PACKAGE_DEB ON)
  set(system_libraries ${HDF5_C_LIBRARY_hdf5})
  if(TARGET Boost::program_options)
    get_target_property(boost_library Boost::program_options LOCATION)
    list(APPEND system_libraries ${boost_library})
  endif()
  foreach(library IN LISTS system_libraries)
    get_filename_component(library "${library}" REALPATH)
    execute_process(COMMAND ${TRELLIS_DPKG_QUERY} -S "${library}" RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
    if(NOT rc EQUAL 0)
      message(STATUS "No .deb package: no Debian package owns ${library}")
      set(TRELLIS_PACKAGE_DEB OFF)
    endif()
  endforeach()
endif()
if(TRELLIS_PACKAGE_DEB)
  list(APPEND CPACK_GENERATOR DEB)
  set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
  set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${TRELLIS_PACKAGE_MAINTAINER}")
  set(CPACK_DEBIAN_PACKAGE_SECTION science)
  set(CPACK_DEBIAN_COMPRESSION_TYPE gzip)
  # Depends: the Debian packages that hold the shared libraries the packaged binaries need and do not find through
  # their own RUNPATH (Boost.Program_options, HDF5, libgomp, the C++ runtime), worked out when cpack runs from the
  # binaries themselves (dpkg-shlibdeps cannot: it fails on LibTorch's libraries, which no package owns).
  set(binaries $<TARGET_FILE:trellis> $<TARGET_FILE:trellis_ops>)
  if(TARGET trellis_cli)
    list(APPEND binaries $<TARGET_FILE:trellis_cli>)
  endif()
  set(CPACK_PROJECT_CONFIG_FILE "${PROJECT_BINARY_DIR}/TrellisCPackOptions.cmake")
  file(GENERATE OUTPUT "${CPACK_PROJECT_CONFIG_FILE}" CONTENT
"if(CPACK_GENERATOR STREQUAL \"DEB\")
  set(TRELLIS_PACKAGED_BINARIES \"${binaries}\")
  set(TRELLIS_OWN_LIBRARIES \"$<TARGET_SONAME_FILE_NAME:trellis>\")
  set(TRELLIS_RUNPATH_DIRS \"${TRELLIS_INSTALL_TORCH_RPATH}\")
  set(TRELLIS_READELF \"${TRELLIS_READELF}\")
  set(TRELLIS_LDCONFIG \"${TRELLIS_LDCONFIG}\")
  include(\"${PROJECT_SOURCE_DIR}/cmake/TrellisDebianDepends.cmake\")
endif()
")
endif()
include(CPack)
