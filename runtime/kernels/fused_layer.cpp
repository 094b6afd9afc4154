// One Llama decoder layer for a few tokens, in one call (torch.ops.sparkgate.decoder_layer_).
//
// A batch-1 decode step of the 135M target is 30 layers x ~45 small torch ops; on a 2-core
// CPU their dispatch costs more than the layer's arithmetic. This op runs the whole layer
// for the M rows of a ragged forward (decode anchors, verification drafts, small prefill
// chunks) with the projections over the GGUF's own blocks (gguf_cpu.cpp):
//
//   h   = rmsnorm(x) * ln1                          -> bf16
//   qkv = h @ Wqkv^T                                -> fp32; RoPE (rotate-half) on q and k
//   K/V of every row -> the cache at (slot_r, pos_r) (bf16), then each row attends, per
//   head, to keys 0..pos_r of its own slot (causal within a span, GQA: head h reads kv
//   head h / (H / KVH)), softmax in fp32                        -> bf16 [M, H*D]
//   x  += o @ Wo^T
//   h2  = rmsnorm(x) * ln2                          -> bf16
//   x  += (silu(g) * u) @ Wdown^T,  [g | u] = h2 @ Wgate_up^T   (silu(g)*u rounded to bf16)
//
// x (fp32 [M, d], the residual stream) is updated in place. Rows beyond `kernel_max_rows`
// use the dense bf16 weights (at::linear) instead of the tiles. Same math as
// runtime/models/llama.py's eager layer; the roundings differ only where eager rounds an
// intermediate to bf16 (projection outputs, RoPE) and this op keeps fp32
// (tests/test_fused_layer.py bounds the difference).
#include "gguf_cpu.h"
#include "work_pool.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline __m512 bf16x16_to_f32(const at::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// exp(x) for 16 lanes (Cephes expf polynomial, ~1 ulp; inputs clamped to avoid overflow).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, fx);
}

float exp_scalar(float v) {
  alignas(64) float buf[16];
  _mm512_store_ps(buf, exp16(_mm512_set1_ps(v)));
  return buf[0];
}

// rmsnorm(x[i]) * w -> bf16 rows (x fp32 [M, d], w fp32 [d]).
at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t M = x.size(0), d = x.size(1);
  at::Tensor out = at::empty({M, d}, x.options().dtype(at::kBFloat16));
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < M; ++i) {
    const float* xi = xp + i * d;
    float ss = 0.f;
    for (int64_t j = 0; j < d; ++j) ss += xi[j] * xi[j];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + static_cast<float>(eps));
    for (int64_t j = 0; j < d; ++j) op[i * d + j] = at::BFloat16(xi[j] * r * wp[j]);
  }
  return out;
}

// h (bf16 [M, K]) @ W^T -> fp32 [M, N]: the GGUF tiles for few rows, the dense bf16 weight
// beyond kernel_max_rows.
at::Tensor project(const at::Tensor& h, const at::Tensor& tiles, int64_t qtype, const at::Tensor& dense,
                   int64_t kernel_max_rows) {
  if (h.size(0) <= kernel_max_rows) return gguf_linear(h, tiles, qtype, dense.size(0), dense.size(1), at::kFloat);
  return at::linear(h, dense).to(at::kFloat);
}

// RoPE (rotate-half, as runtime/models/llama.py Rotary.apply) of one head vector in place.
inline void rope(float* v, const float* c, const float* s, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = v[j], b = v[j + half];
    v[j] = a * c[j] - b * s[j];
    v[j + half] = b * c[j + half] + a * s[j + half];
  }
}

// Attention of M rows (see the file comment). qkv fp32 [M, (H + 2 KVH) D] is RoPE'd in
// place; returns bf16 [M, H D].
at::Tensor attend(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kc, at::Tensor& vc,
                  const int64_t* slots, const int64_t* positions, int64_t H, int64_t KVH, int64_t D) {
  const int64_t M = qkv.size(0), W = qkv.size(1);
  const int64_t L = kc.size(2);
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::BFloat16* kp = kc.data_ptr<at::BFloat16>();
  at::BFloat16* vp = vc.data_ptr<at::BFloat16>();
  auto cache_row = [&](at::BFloat16* base, int64_t slot, int64_t g, int64_t pos) {
    return base + ((slot * KVH + g) * L + pos) * D;
  };
  at::Tensor qb = at::empty({M, H, D}, qkv.options().dtype(at::kBFloat16));  // q as eager has it: bf16
  at::BFloat16* qbp = qb.data_ptr<at::BFloat16>();
  for (int64_t r = 0; r < M; ++r) {
    const int64_t pos = positions[r], slot = slots[r];
    TORCH_CHECK(pos >= 0 && pos < L && pos < cos.size(0), "decoder_layer_: position ", pos, " out of range");
    float* row = qp + r * W;
    for (int64_t h = 0; h < H + KVH; ++h) rope(row + h * D, cp + pos * D, sp + pos * D, D);
    for (int64_t i = 0; i < H * D; ++i) qbp[r * H * D + i] = at::BFloat16(row[i]);
    for (int64_t g = 0; g < KVH; ++g) {
      at::BFloat16* kd = cache_row(kp, slot, g, pos);
      at::BFloat16* vd = cache_row(vp, slot, g, pos);
      for (int64_t j = 0; j < D; ++j) {
        kd[j] = at::BFloat16(row[(H + g) * D + j]);
        vd[j] = at::BFloat16(row[(H + KVH + g) * D + j]);
      }
    }
  }
  at::Tensor out = at::empty({M, H * D}, qkv.options().dtype(at::kBFloat16));
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const int64_t group = H / KVH;
  const int64_t DV = D / 16;  // zmm per head vector (D % 16 == 0, checked)
  sparkgate::WorkPool::instance().run(M * H, [&](int64_t idx) {
    thread_local std::vector<float> score;
    if (static_cast<int64_t>(score.size()) < L + 16) score.resize(L + 16);
    __m512 q[8], o[8];
    {
      const int64_t r = idx / H, h = idx % H, g = h / group;
      const int64_t n = positions[r] + 1, slot = slots[r];
      for (int64_t v = 0; v < DV; ++v) q[v] = _mm512_mul_ps(bf16x16_to_f32(qbp + (r * H + h) * D + 16 * v), _mm512_set1_ps(scale));
      const at::BFloat16* krow = cache_row(kp, slot, g, 0);
      float mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        __m512 acc = _mm512_mul_ps(q[0], bf16x16_to_f32(krow + j * D));
        for (int64_t v = 1; v < DV; ++v) acc = _mm512_fmadd_ps(q[v], bf16x16_to_f32(krow + j * D + 16 * v), acc);
        const float s = _mm512_reduce_add_ps(acc);
        score[j] = s;
        mx = s > mx ? s : mx;
      }
      __m512 sum16 = _mm512_setzero_ps();
      int64_t j = 0;
      for (; j + 16 <= n; j += 16) {
        const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(score.data() + j), _mm512_set1_ps(mx)));
        _mm512_storeu_ps(score.data() + j, p);
        sum16 = _mm512_add_ps(sum16, p);
      }
      float sum = _mm512_reduce_add_ps(sum16);
      for (; j < n; ++j) {
        score[j] = exp_scalar(score[j] - mx);
        sum += score[j];
      }
      for (int64_t v = 0; v < DV; ++v) o[v] = _mm512_setzero_ps();
      const at::BFloat16* vrow = cache_row(vp, slot, g, 0);
      for (int64_t jj = 0; jj < n; ++jj) {
        const __m512 p = _mm512_set1_ps(score[jj]);
        for (int64_t v = 0; v < DV; ++v) o[v] = _mm512_fmadd_ps(p, bf16x16_to_f32(vrow + jj * D + 16 * v), o[v]);
      }
      const __m512 inv = _mm512_set1_ps(1.f / sum);
      alignas(64) float tmp[16];
      for (int64_t v = 0; v < DV; ++v) {
        _mm512_store_ps(tmp, _mm512_mul_ps(o[v], inv));
        for (int k = 0; k < 16; ++k) op[(r * H + h) * D + 16 * v + k] = at::BFloat16(tmp[k]);
      }
    }
  });
  return out;
}

// silu(g) * u -> bf16 [M, I] from fp32 [M, 2I] = [g | u].
at::Tensor silu_mul_bf16(const at::Tensor& gu, int64_t I) {
  const int64_t M = gu.size(0);
  at::Tensor out = at::empty({M, I}, gu.options().dtype(at::kBFloat16));
  const float* p = gu.data_ptr<float>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  alignas(64) float tmp[16];
  for (int64_t i = 0; i < M; ++i) {
    const float* g = p + i * 2 * I;
    const float* u = g + I;
    int64_t j = 0;
    for (; j + 16 <= I; j += 16) {
      const __m512 gv = _mm512_loadu_ps(g + j);
      const __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
      _mm512_store_ps(tmp, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(u + j)));
      for (int k = 0; k < 16; ++k) op[i * I + j + k] = at::BFloat16(tmp[k]);
    }
    for (; j < I; ++j) op[i * I + j] = at::BFloat16(g[j] / (1.f + exp_scalar(-g[j])) * u[j]);
  }
  return out;
}

}  // namespace

void decoder_layer_(at::Tensor x, const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                    const at::Tensor& qkv_tiles, const at::Tensor& qkv_dense, const at::Tensor& o_tiles,
                    const at::Tensor& o_dense, const at::Tensor& gu_tiles, const at::Tensor& gu_dense,
                    const at::Tensor& down_tiles, const at::Tensor& down_dense, int64_t qtype,
                    const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                    const at::Tensor& slots, const at::Tensor& positions, int64_t num_heads, int64_t num_kv_heads,
                    int64_t kernel_max_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "decoder_layer_: x must be contiguous fp32 [M, d]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kBFloat16 && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kBFloat16 && v_cache.is_contiguous(),
              "decoder_layer_: caches must be contiguous bf16 [slots, kv_heads, len, head_dim]");
  const int64_t M = x.size(0), D = k_cache.size(3);
  TORCH_CHECK(D % 16 == 0 && D <= 128 && num_heads % num_kv_heads == 0 && k_cache.size(1) == num_kv_heads,
              "decoder_layer_: unsupported attention geometry");
  TORCH_CHECK(slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && slots.numel() == M &&
                  positions.numel() == M && slots.is_contiguous() && positions.is_contiguous(),
              "decoder_layer_: slots and positions must be contiguous int64 [M]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.size(1) == D,
              "decoder_layer_: rotary tables must be fp32 [max_position, head_dim]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) TORCH_CHECK(sl[r] >= 0 && sl[r] < k_cache.size(0), "decoder_layer_: bad slot");
  if (M == 0) return;
  at::Tensor qkv = project(rms_norm_bf16(x, ln1, eps), qkv_tiles, qtype, qkv_dense, kernel_max_rows);
  at::Tensor attn = attend(qkv, cos, sin, k_cache, v_cache, sl, positions.data_ptr<int64_t>(), num_heads,
                           num_kv_heads, D);
  x.add_(project(attn, o_tiles, qtype, o_dense, kernel_max_rows));
  at::Tensor gu = project(rms_norm_bf16(x, ln2, eps), gu_tiles, qtype, gu_dense, kernel_max_rows);
  x.add_(project(silu_mul_bf16(gu, gu.size(1) / 2), down_tiles, qtype, down_dense, kernel_max_rows));
}

TORCH_LIBRARY_FRAGMENT(sparkgate, m) {
  m.def("decoder_layer_(Tensor(a!) x, Tensor ln1, Tensor ln2, float eps, Tensor qkv_tiles, Tensor qkv_dense, "
        "Tensor o_tiles, Tensor o_dense, Tensor gu_tiles, Tensor gu_dense, Tensor down_tiles, Tensor down_dense, "
        "int qtype, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, Tensor positions, "
        "int num_heads, int num_kv_heads, int kernel_max_rows) -> ()");
}

TORCH_LIBRARY_IMPL(sparkgate, CPU, m) {
  m.impl("decoder_layer_", &decoder_layer_);
}
