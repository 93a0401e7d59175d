# Drives the consumer project (cmake -P): [install whale] → configure → build → run.
# -DMODE=find_package|add_subdirectory -DSOURCE_DIR=<whale source> -DBINARY_DIR=<whale build>
# -DWORK_DIR=<scratch> -DGENERATOR= -DMAKE_PROGRAM= -DCXX_COMPILER= -DBUILD_TYPE=
# -DENABLE_CUDA=ON|OFF -DMPIEXEC=<mpiexec or empty> -DEXPECT_CORE=0|1 (whale built whale::core)
cmake_minimum_required(VERSION 3.25)

function(step what)
  message(STATUS "consumer (${MODE}): ${what}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc COMMAND_ECHO STDOUT)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer (${MODE}): ${what} failed (${rc})")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(_args -S ${SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build -G ${GENERATOR}
  -DCMAKE_BUILD_TYPE=${BUILD_TYPE} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
  -DWHALE_CONSUMER_MODE=${MODE})
if(MAKE_PROGRAM)
  list(APPEND _args -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM})
endif()
if(MODE STREQUAL "find_package")
  step("install whale to ${WORK_DIR}/prefix"
    ${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${WORK_DIR}/prefix)
  list(APPEND _args -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON)
else()
  list(APPEND _args -DWHALE_SOURCE_DIR=${SOURCE_DIR} -DWHALE_ENABLE_CUDA=${ENABLE_CUDA})
endif()
step("configure" ${CMAKE_COMMAND} ${_args})
step("build" ${CMAKE_COMMAND} --build ${WORK_DIR}/build --parallel 2)

step("run app (whale::whale)" ${WORK_DIR}/build/app)
if(EXISTS ${WORK_DIR}/build/app_mpi)
  if(MPIEXEC)
    step("run app_mpi (whale::mpi) on 2 ranks"
      ${MPIEXEC} -np 2 --oversubscribe --bind-to none ${WORK_DIR}/build/app_mpi)
  else()
    step("run app_mpi (whale::mpi)" ${WORK_DIR}/build/app_mpi)
  endif()
elseif(MPIEXEC)
  message(FATAL_ERROR "consumer (${MODE}): whale::mpi was configured in whale but not in the consumer")
endif()
foreach(exe plan_mpi plan_core)  # a plan trained against one process, on 2 ranks where mpiexec is known
  if(EXISTS ${WORK_DIR}/build/${exe})
    if(MPIEXEC)
      step("run ${exe} on 2 ranks" ${MPIEXEC} -np 2 --oversubscribe --bind-to none ${WORK_DIR}/build/${exe})
    else()
      step("run ${exe}" ${WORK_DIR}/build/${exe})
    endif()
  endif()
endforeach()
if(EXISTS ${WORK_DIR}/build/app_core)  # the compiled core (whale::core), where whale built it
  step("run app_core (whale::core)" ${WORK_DIR}/build/app_core)
elseif(EXPECT_CORE AND MODE STREQUAL "find_package")
  message(FATAL_ERROR "consumer (${MODE}): whale built whale::core but the installed package did not give it")
endif()
foreach(exe app_cuda app_cu)
  if(EXISTS ${WORK_DIR}/build/${exe})
    step("run ${exe} (whale::cuda)" ${WORK_DIR}/build/${exe})
  endif()
endforeach()
message(STATUS "consumer (${MODE}): passed")
