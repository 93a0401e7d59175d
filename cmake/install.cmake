# Installation and package config so that find_package(whale) works.
include(CMakePackageConfigHelpers)
set(_whale_targets whale)
if(TARGET whale_mpi)
  list(APPEND _whale_targets whale_mpi)
endif()
if(TARGET whale_cuda)
  list(APPEND _whale_targets whale_cuda)
endif()
install(TARGETS ${_whale_targets} EXPORT whaleTargets)
install(DIRECTORY include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT whaleTargets NAMESPACE whale:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/whale)
configure_package_config_file(cmake/whaleConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/whaleConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/whale)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/whaleConfigVersion.cmake
  COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/whaleConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/whaleConfigVersion.cmake
  cmake/FindOpenBLAS.cmake cmake/FindNCCL.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/whale)
