# The sources of tiermoe_cuda_check, relative to tests/cuda/: one list for both builds of it (the
# project's CMakeLists.txt and tests/cuda/CMakeLists.txt, the stand-alone one for GPU machines).
set(TIERMOE_CUDA_CHECK_SOURCES cuda_check.cpp check_harness.cpp check_gemv.cpp check_norm_rope.cpp check_moe.cpp
    check_attention.cpp check_kv_fp8.cpp check_sampling.cpp check_models.cpp bench_modes.cpp sync_latency.cu decode_chain.cu
    fp8_dequantize.cu coded_tile.cu)
list(TRANSFORM TIERMOE_CUDA_CHECK_SOURCES PREPEND ${CMAKE_CURRENT_LIST_DIR}/)
