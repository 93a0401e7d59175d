# Consumer checks (label "consumer"): tests/consumer/ is a user project that
# takes whale through find_package (from an install into the build tree) and
# through add_subdirectory of this source tree, then builds and runs.
set(_consumer_mpiexec "")
if(TARGET whale::mpi)
  set(_consumer_mpiexec ${MPIEXEC_EXECUTABLE})
endif()
foreach(_mode find_package add_subdirectory)
  add_test(NAME consumer_${_mode}
    COMMAND ${CMAKE_COMMAND}
      -DMODE=${_mode}
      -DSOURCE_DIR=${whale_SOURCE_DIR}
      -DBINARY_DIR=${whale_BINARY_DIR}
      -DWORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/consumer_${_mode}
      -DGENERATOR=${CMAKE_GENERATOR}
      -DMAKE_PROGRAM=${CMAKE_MAKE_PROGRAM}
      -DCXX_COMPILER=${CMAKE_CXX_COMPILER}
      -DBUILD_TYPE=$<IF:$<CONFIG:>,Release,$<CONFIG>>
      -DENABLE_CUDA=${WHALE_ENABLE_CUDA}
      -DMPIEXEC=${_consumer_mpiexec}
      -DEXPECT_CORE=$<TARGET_EXISTS:whale_core>
      -P ${CMAKE_CURRENT_SOURCE_DIR}/consumer/check.cmake)
  set_tests_properties(consumer_${_mode} PROPERTIES LABELS consumer TIMEOUT 240 PROCESSORS 2
    ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OPENBLAS_NUM_THREADS=1")
endforeach()
