# Install rules and the package config, so that find_package(whale) works.
# One export set per target: whale::whale always; whale::mpi and whale::cuda
# only when they were configured here. The config finds each backend's
# dependencies and makes the backend target only when they are found, so
# `find_package(whale COMPONENTS mpi)` fails cleanly where MPI is missing.
# The profiler, whale_profile, goes to bin/ where it was built (with MPI).
include(CMakePackageConfigHelpers)
set(_whale_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/whale)

install(TARGETS whale EXPORT whaleTargets)
install(EXPORT whaleTargets NAMESPACE whale:: DESTINATION ${_whale_cmake_dir})
set(WHALE_EXPORTED_COMPONENTS "")
if(TARGET whale_mpi)
  install(TARGETS whale_mpi EXPORT whaleMpiTargets)
  install(EXPORT whaleMpiTargets NAMESPACE whale:: DESTINATION ${_whale_cmake_dir})
  list(APPEND WHALE_EXPORTED_COMPONENTS mpi)
endif()
if(TARGET whale_core)
  install(TARGETS whale_core EXPORT whaleCoreTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(EXPORT whaleCoreTargets NAMESPACE whale:: DESTINATION ${_whale_cmake_dir})
  list(APPEND WHALE_EXPORTED_COMPONENTS core)
endif()
if(TARGET whale_cuda)
  install(TARGETS whale_cuda EXPORT whaleCudaTargets)
  install(EXPORT whaleCudaTargets NAMESPACE whale:: DESTINATION ${_whale_cmake_dir})
  list(APPEND WHALE_EXPORTED_COMPONENTS cuda)
endif()

# the profiler (measures a device profile: docs/plan-search.md), where it was built
if(TARGET whale_profile)
  install(TARGETS whale_profile RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

install(DIRECTORY ${CMAKE_CURRENT_LIST_DIR}/../include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/whaleConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/whaleConfig.cmake
  INSTALL_DESTINATION ${_whale_cmake_dir})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/whaleConfigVersion.cmake
  COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/whaleConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/whaleConfigVersion.cmake
  ${CMAKE_CURRENT_LIST_DIR}/FindOpenBLAS.cmake ${CMAKE_CURRENT_LIST_DIR}/FindNCCL.cmake
  DESTINATION ${_whale_cmake_dir})
