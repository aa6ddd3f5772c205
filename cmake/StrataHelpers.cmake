# Build flags and helper functions shared by every Strata folder.

add_library(strata_build_flags INTERFACE)
target_compile_options(strata_build_flags INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter -Wno-sign-compare -Wno-missing-field-initializers>)
target_include_directories(strata_build_flags INTERFACE ${PROJECT_SOURCE_DIR})
if(STRATA_WERROR)
  target_compile_options(strata_build_flags INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
endif()
if(STRATA_SANITIZE)
  target_compile_options(strata_build_flags INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${STRATA_SANITIZE} -fno-omit-frame-pointer>)
  target_link_options(strata_build_flags INTERFACE -fsanitize=${STRATA_SANITIZE})
endif()

# strata_cc_library(NAME name SRCS ... [PUBLIC_DEPS ...] [PRIVATE_DEPS ...])
# Defines target strata_<name> with alias strata::<name>.
function(strata_cc_library)
  cmake_parse_arguments(A "" "NAME" "SRCS;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(strata_${A_NAME} STATIC ${A_SRCS})
  add_library(strata::${A_NAME} ALIAS strata_${A_NAME})
  target_link_libraries(strata_${A_NAME} PUBLIC strata_build_flags ${A_PUBLIC_DEPS} PRIVATE ${A_PRIVATE_DEPS})
  set_target_properties(strata_${A_NAME} PROPERTIES POSITION_INDEPENDENT_CODE ON)
endfunction()

# strata_cc_test(NAME name SRCS ... DEPS ... [LABELS ...] [TIMEOUT seconds])
# A GoogleTest binary registered with ctest test by test (gtest_discover_tests).
function(strata_cc_test)
  if(NOT STRATA_BUILD_TESTS)
    return()
  endif()
  cmake_parse_arguments(A "" "NAME;TIMEOUT" "SRCS;DEPS;LABELS" ${ARGN})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 120)
  endif()
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE strata_build_flags ${A_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  set_target_properties(${A_NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  gtest_discover_tests(${A_NAME}
    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
    PROPERTIES LABELS unit TIMEOUT ${A_TIMEOUT}
    DISCOVERY_TIMEOUT 60)
  # Extra labels (e.g. gpu): gtest_discover_tests flattens a list-valued LABELS into separate
  # arguments, so a ctest include file read after the discovered tests sets them instead.
  if("gpu" IN_LIST A_LABELS)
    # scripts/gpu_run.sh builds and bundles these (build dir gpu_test_targets.txt, written by
    # the top-level CMakeLists): ctest lists discovered tests only once their binaries exist.
    set_property(GLOBAL APPEND PROPERTY STRATA_GPU_TEST_TARGETS ${A_NAME})
  endif()
  if(A_LABELS)
    set(labels unit ${A_LABELS})
    set(inc ${CMAKE_CURRENT_BINARY_DIR}/${A_NAME}_labels.cmake)
    file(WRITE ${inc}
      "foreach(t IN LISTS ${A_NAME}_TESTS)\n"
      "  set_tests_properties(\"\${t}\" PROPERTIES LABELS \"${labels}\")\n"
      "endforeach()\n")
    set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${inc})
  endif()
endfunction()
