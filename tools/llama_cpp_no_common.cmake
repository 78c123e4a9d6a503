# Included by CMake right after llama.cpp's project() call (CMAKE_PROJECT_llama.cpp_INCLUDE, set by
# tools/install_llama_cpp.sh): llama-cpp-python forces llama.cpp's common library on, yet neither
# it nor specrun loads that library, whose build took 208 of 397 seconds on CI's two cores.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama: build common utils library" FORCE)
