// Shared declarations of the CPU kernels in gguf_cpu.cpp (used by fused_layer.cpp).
#pragma once
#include <ATen/ATen.h>

// y[M, N] = x[M, K] (bf16) @ W^T, W given as repacked GGML tiles (see gguf_cpu.cpp).
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t qtype, int64_t N, int64_t K,
                       at::ScalarType out_dtype);

// Whether the kernels may use AMX tiles (Python enables it on CPUs that list amx_bf16).
bool gguf_amx_enabled();
