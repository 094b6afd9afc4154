// The Llama decoder layers for the rows of a forward, in one call (torch.classes.sparkgate.FusedModel).
//
// A batch-1 decode step of the 135M target is 30 layers x ~45 small torch ops; on a 2-core
// CPU their dispatch costs more than the layers' arithmetic. FusedModel.forward_ runs every
// layer for the M rows of a ragged forward (decode anchors, verification drafts, prefill
// chunks) with the projections over the GGUF's own blocks (gguf_cpu.cpp). Per layer:
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
// forward_block_ is the same with a per-row key count (the DSpark drafter's block: every slot
// of a block sees the whole block) and context_ writes the drafter's context K/V
// (runtime/speculation/fast_drafter.py); the drafter's layers are a second FusedModel with Q8_0 tiles.
//
// x (fp32 [M, d], the residual stream) is updated in place. Every row's arithmetic is its
// own (projections: gguf_cpu.cpp's fixed summation order; norms, RoPE, attention, SwiGLU:
// per-row loops, no split over a row's reduction), so a row's result does not depend on the
// other rows of the call (tests/runtime/kernels/test_row_invariance.py). With
// `kernel_max_rows` >= 0 (the drafter's FusedModel) rows beyond it use the dense bf16 weights
// (at::linear) instead of the tiles, which gives up that property; the target passes -1. Same math as
// runtime/models/llama.py's eager layer; the roundings differ only where eager rounds an
// intermediate to bf16 (projection outputs, RoPE) and this op keeps fp32
// (tests/runtime/kernels/test_gguf_kernel.py compares both with an exact fp32 reference).
#include "gguf_cpu.h"
#include "work_pool.h"

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
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

// h (bf16 [M, K]) @ W^T -> fp32 [M, N]: the GGUF tiles (every row count when kernel_max_rows
// < 0), else the dense bf16 weight beyond kernel_max_rows.
at::Tensor project(const at::Tensor& h, const at::Tensor& tiles, int64_t qtype, const at::Tensor& dense,
                   int64_t kernel_max_rows) {
  if (kernel_max_rows < 0 || h.size(0) <= kernel_max_rows)
    return gguf_linear(h, tiles, qtype, dense.size(0), dense.size(1), at::kFloat);
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

// exp(s_j - max) in place over n scores; returns their sum (the caller divides).
float softmax_unnormalised(float* s, int64_t n) {
  __m512 mx16 = _mm512_set1_ps(-INFINITY);  // the max is exact in any order
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) mx16 = _mm512_max_ps(mx16, _mm512_loadu_ps(s + j));
  float mx = _mm512_reduce_max_ps(mx16);
  for (; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
  __m512 sum16 = _mm512_setzero_ps();
  j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(mx)));
    _mm512_storeu_ps(s + j, p);
    sum16 = _mm512_add_ps(sum16, p);
  }
  float sum = _mm512_reduce_add_ps(sum16);
  for (; j < n; ++j) {
    s[j] = exp_scalar(s[j] - mx);
    sum += s[j];
  }
  return sum;
}

// Writes the K/V of one qkv row (fp32 [(H + 2 KVH) D], k already RoPE'd) into bf16 caches
// [slots, KVH, L, D] at (slot, pos).
inline void store_kv(const float* row, int64_t H, int64_t KVH, int64_t D, at::BFloat16* kp, at::BFloat16* vp,
                     int64_t L, int64_t slot, int64_t pos) {
  for (int64_t g = 0; g < KVH; ++g) {
    at::BFloat16* kd = kp + ((slot * KVH + g) * L + pos) * D;
    at::BFloat16* vd = vp + ((slot * KVH + g) * L + pos) * D;
    for (int64_t j = 0; j < D; ++j) {
      kd[j] = at::BFloat16(row[(H + g) * D + j]);
      vd[j] = at::BFloat16(row[(H + KVH + g) * D + j]);
    }
  }
}

struct AttnTileConfig {  // LDTILECFG layout, palette 1
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_attention_usable() {  // the same permission request as gguf_cpu.cpp (idempotent)
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return gguf_amx_enabled() && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// Scores of `group` query heads (bf16 rows of D = 64) against keys [0, 16 * floor(n / 16)):
// per block of 16 keys, C[key][head] = K_block (16 x 32 dims, straight from the cache) x
// Q^T (32 dims as VNNI pairs x heads), twice for the two halves of D. Writes
// score[h * stride + j] (scaled) and returns the number of keys done.
int64_t qk_amx(const at::BFloat16* q, const at::BFloat16* k, int64_t n, int64_t group, float scale, float* score,
               int64_t stride) {
  constexpr int64_t D = 64;
  const int64_t blocks = n / 16;
  if (blocks == 0) return 0;
  AttnTileConfig cfg;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = 16;
  cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[2] = 64;
  _tile_loadconfig(&cfg);
  alignas(64) uint16_t qb[2][16 * 32] = {};  // [half][dim pair][head, 2 dims]
  const uint16_t* qs = reinterpret_cast<const uint16_t*>(q);
  for (int64_t h = 0; h < group; ++h)
    for (int64_t d = 0; d < D; ++d) qb[d / 32][((d % 32) / 2) * 32 + 2 * h + (d % 2)] = qs[h * D + d];
  alignas(64) float c[16 * 16];
  for (int64_t b = 0; b < blocks; ++b) {
    _tile_zero(0);
    _tile_loadd(1, k + b * 16 * D, D * 2);
    _tile_loadd(2, qb[0], 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_loadd(1, k + b * 16 * D + 32, D * 2);
    _tile_loadd(2, qb[1], 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, c, 64);
    for (int64_t i = 0; i < 16; ++i)
      for (int64_t h = 0; h < group; ++h) score[h * stride + b * 16 + i] = c[i * 16 + h] * scale;
  }
  _tile_release();
  return blocks * 16;
}

// Lane i of the result = the sum of a[i]'s 16 lanes, by one fixed tree for every key: the
// 128-bit quarters as (Q0 + Q2) + (Q1 + Q3), then its 4 floats as (f0 + f2) + (f1 + f3). Sixteen
// scores cost ~16 shuffles and adds instead of ~8 each; a key's score is the same whichever
// block of 16 it is summed in.
inline __m512 reduce16(const __m512 (&a)[16]) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // quarters [a_i: Q0+Q2, Q1+Q3 | a_i+8: Q0+Q2, Q1+Q3]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarters [a_i | a_i+8 | a_i+4 | a_i+12], each (Q0+Q2)+(Q1+Q3)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)  // per quarter [c_i: f0+f2, c_i+2: f0+f2, c_i: f1+f3, c_i+2: f1+f3]
    d[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[i], c[i + 2]), _mm512_unpackhi_ps(c[i], c[i + 2]));
  // per quarter q the totals of c_0..c_3, i.e. lane 4q + e holds key e + (0, 8, 4, 12)[q]
  const __m512 e = _mm512_add_ps(_mm512_unpacklo_ps(d[0], d[1]), _mm512_unpackhi_ps(d[0], d[1]));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15), e);
}

// Scores of hn query heads (qf: fp32 [hn][D], already scaled) against keys [j0, n) of one
// slot's K rows (bf16 [.., D]), into score[h * stride + key]. Per key, as a row of 16 lanes:
// q[0:16] * k[0:16], then fma over the next 16-dim pieces in order, then reduce16.
void qk_scores(const float* qf, int64_t hn, const at::BFloat16* k, int64_t j0, int64_t n, int64_t D, float* score,
               int64_t stride) {
  const int64_t DV = D / 16;
  alignas(64) float kf[16 * 128];  // one block of 16 keys in fp32 (zeros past n)
  for (int64_t jj = j0; jj < n; jj += 16) {
    const int64_t nk = std::min<int64_t>(16, n - jj);
    for (int64_t kk = 0; kk < 16; ++kk)
      for (int64_t v = 0; v < DV; ++v)
        _mm512_store_ps(kf + kk * D + 16 * v, kk < nk ? bf16x16_to_f32(k + (jj + kk) * D + 16 * v) : _mm512_setzero_ps());
    const __mmask16 mask = static_cast<__mmask16>((1u << nk) - 1);
    for (int64_t h = 0; h < hn; ++h) {
      const float* q = qf + h * D;
      __m512 acc[16];
      const __m512 q0 = _mm512_load_ps(q);
      for (int kk = 0; kk < 16; ++kk) acc[kk] = _mm512_mul_ps(q0, _mm512_load_ps(kf + kk * D));
      for (int64_t v = 1; v < DV; ++v) {
        const __m512 qv = _mm512_load_ps(q + 16 * v);
        for (int kk = 0; kk < 16; ++kk) acc[kk] = _mm512_fmadd_ps(qv, _mm512_load_ps(kf + kk * D + 16 * v), acc[kk]);
      }
      _mm512_mask_storeu_ps(score + h * stride + jj, mask, reduce16(acc));
    }
  }
}

// out[h] = bf16(inv_sum[h] * sum_j p[h][j] v_j) for HN heads over keys [0, n) (V bf16 [.., D]),
// NV 16-dim pieces from piece v0; per head and piece one fma chain over the keys in order.
template <int HN, int NV>
void pv_heads(const float* score, int64_t stride, const at::BFloat16* vrow, int64_t n, int64_t D, int64_t v0,
              const float* inv_sum, at::BFloat16* out) {
  __m512 o[HN][NV];
  for (int h = 0; h < HN; ++h)
    for (int v = 0; v < NV; ++v) o[h][v] = _mm512_setzero_ps();
  for (int64_t jj = 0; jj < n; ++jj) {
    __m512 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = bf16x16_to_f32(vrow + jj * D + 16 * (v0 + v));
    for (int h = 0; h < HN; ++h) {
      const __m512 p = _mm512_set1_ps(score[h * stride + jj]);
      for (int v = 0; v < NV; ++v) o[h][v] = _mm512_fmadd_ps(p, vv[v], o[h][v]);
    }
  }
  for (int h = 0; h < HN; ++h) {
    alignas(64) float tmp[16];
    const __m512 inv = _mm512_set1_ps(inv_sum[h]);
    for (int v = 0; v < NV; ++v) {
      _mm512_store_ps(tmp, _mm512_mul_ps(o[h][v], inv));
      for (int k = 0; k < 16; ++k) out[h * D + 16 * (v0 + v) + k] = at::BFloat16(tmp[k]);
    }
  }
}

template <int HN>
void pv_pieces(const float* score, int64_t stride, const at::BFloat16* vrow, int64_t n, int64_t D,
               const float* inv_sum, at::BFloat16* out) {
  for (int64_t v0 = 0; v0 < D / 16; v0 += 4) {
    switch (std::min<int64_t>(4, D / 16 - v0)) {
      case 4: pv_heads<HN, 4>(score, stride, vrow, n, D, v0, inv_sum, out); break;
      case 3: pv_heads<HN, 3>(score, stride, vrow, n, D, v0, inv_sum, out); break;
      case 2: pv_heads<HN, 2>(score, stride, vrow, n, D, v0, inv_sum, out); break;
      default: pv_heads<HN, 1>(score, stride, vrow, n, D, v0, inv_sum, out); break;
    }
  }
}

// Attention of M rows (see the file comment). qkv fp32 [M, (H + 2 KVH) D] is RoPE'd in
// place; returns bf16 [M, H D]. Every row's K/V is written before any row attends, so
// with kv_lens (non-null) row r attends to keys [0, kv_lens[r]) of its slot instead of
// [0, positions[r]] -- the drafter's block (bidirectional among its own slots).
at::Tensor attend(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kc, at::Tensor& vc,
                  const int64_t* slots, const int64_t* positions, const int64_t* kv_lens, int64_t H, int64_t KVH,
                  int64_t D) {
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
    store_kv(row, H, KVH, D, kp, vp, L, slot, pos);
  }
  at::Tensor out = at::empty({M, H * D}, qkv.options().dtype(at::kBFloat16));
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const int64_t group = H / KVH;  // query heads per kv head (GQA; D % 16 == 0 and D <= 128, checked)
  const bool amx = amx_attention_usable() && D == 64 && group <= 16;
  // One task per (row, kv head): its query heads share every K/V load. With few rows that
  // is fewer tasks than threads x 2, so each kv head's query heads get a task each instead.
  auto& pool = sparkgate::WorkPool::instance();
  const int64_t per_task = M * KVH >= 2 * pool.threads() ? group : 1;  // query heads per task
  const int64_t tasks_per_row = H / per_task;
  pool.run(M * tasks_per_row, [&](int64_t task) {
    const int64_t r = task / tasks_per_row, h0 = (task % tasks_per_row) * per_task, g = h0 / group;
    const int64_t n = kv_lens != nullptr ? kv_lens[r] : positions[r] + 1, slot = slots[r];
    const int64_t hn = per_task;
    thread_local std::vector<float> score;  // [hn][n]
    if (static_cast<int64_t>(score.size()) < hn * (L + 16)) score.resize(hn * (L + 16));
    const int64_t stride = L + 16;
    const at::BFloat16* krow = cache_row(kp, slot, g, 0);
    const at::BFloat16* vrow = cache_row(vp, slot, g, 0);
    const at::BFloat16* qh0 = qbp + (r * H + h0) * D;  // this task's query heads, bf16
    int64_t j = 0;
    if (amx) j = qk_amx(qh0, krow, n, hn, scale, score.data(), stride);
    alignas(64) float qf[16 * 128];  // the heads' q, fp32, scaled
    for (int64_t i = 0; i < hn * D; i += 16)
      _mm512_store_ps(qf + i, _mm512_mul_ps(bf16x16_to_f32(qh0 + i), _mm512_set1_ps(scale)));
    qk_scores(qf, hn, krow, j, n, D, score.data(), stride);  // the keys AMX did not cover (all, without AMX)
    float inv_sum[16];
    for (int64_t h = 0; h < hn; ++h) inv_sum[h] = 1.f / softmax_unnormalised(score.data() + h * stride, n);
    at::BFloat16* dst = op + (r * H + h0) * D;
    for (int64_t h = 0; h < hn;) {  // up to 3 heads share each V load (registers: 3 x 4 accumulators)
      const float* sc = score.data() + h * stride;
      switch (std::min<int64_t>(3, hn - h)) {
        case 3: pv_pieces<3>(sc, stride, vrow, n, D, inv_sum + h, dst + h * D); h += 3; break;
        case 2: pv_pieces<2>(sc, stride, vrow, n, D, inv_sum + h, dst + h * D); h += 2; break;
        default: pv_pieces<1>(sc, stride, vrow, n, D, inv_sum + h, dst + h * D); h += 1; break;
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

// The target's layers, registered once (torch.classes.sparkgate.FusedModel), so a forward is
// ONE call from Python whatever the number of layers (per-layer calls with ~20 arguments each
// cost ~60 us of dispatch per layer, 1.8 ms of a 7 ms batch-1 step).
struct FusedModel : torch::CustomClassHolder {
  struct Layer {
    at::Tensor ln1, ln2, qkv_t, qkv_d, o_t, o_d, gu_t, gu_d, down_t, down_d;
  };
  std::vector<Layer> layers;
  double eps;
  int64_t qtype, heads, kv_heads, kernel_max_rows;
  at::Tensor cos, sin;

  FusedModel(double eps_, int64_t qtype_, int64_t heads_, int64_t kv_heads_, int64_t kernel_max_rows_, at::Tensor cos_,
             at::Tensor sin_)
      : eps(eps_), qtype(qtype_), heads(heads_), kv_heads(kv_heads_), kernel_max_rows(kernel_max_rows_),
        cos(std::move(cos_)), sin(std::move(sin_)) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= 16,
                "FusedModel: unsupported attention geometry");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                    cos.sizes() == sin.sizes() && cos.is_contiguous() && sin.is_contiguous(),
                "FusedModel: rotary tables must be contiguous fp32 [max_position, head_dim]");
  }

  // Norm weights fp32 [d]; each projection as (tiles uint8, dense bf16 [out, in]).
  void add_layer(at::Tensor ln1, at::Tensor ln2, at::Tensor qkv_t, at::Tensor qkv_d, at::Tensor o_t, at::Tensor o_d,
                 at::Tensor gu_t, at::Tensor gu_d, at::Tensor down_t, at::Tensor down_d) {
    TORCH_CHECK(ln1.scalar_type() == at::kFloat && ln2.scalar_type() == at::kFloat && ln1.is_contiguous() &&
                    ln2.is_contiguous(), "FusedModel.add_layer: norm weights must be contiguous fp32");
    layers.push_back({ln1, ln2, qkv_t, qkv_d, o_t, o_d, gu_t, gu_d, down_t, down_d});
  }

  // Runs every layer on the fp32 residual stream x [M, d] in place; K/V of the rows go into
  // k_cache / v_cache ([layers, slots, kv_heads, len, head_dim] bf16) at (slots[r], positions[r]).
  // Returns x after each layer in `taps` as fp32 [M, len(taps), d] (the drafter's features).
  at::Tensor forward_(at::Tensor x, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots, at::Tensor positions,
                      std::vector<int64_t> taps) {
    return run(x, k_cache, v_cache, slots, positions, nullptr, taps);
  }

  // forward_ where row r attends to keys [0, kv_lens[r]) of its slot (int64 [M], each in
  // (positions[r], len]): the DSpark drafter's block, whose slots p..p+g-1 all see
  // [0, p+g) (runtime/speculation/fast_drafter.py). Returns nothing; x is updated in place.
  void forward_block_(at::Tensor x, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots, at::Tensor positions,
                      at::Tensor kv_lens) {
    TORCH_CHECK(x.dim() == 2, "FusedModel.forward_block_: x must be [M, d]");
    check(x.size(0), k_cache, v_cache, slots, positions);  // before positions is read below
    TORCH_CHECK(kv_lens.scalar_type() == at::kLong && kv_lens.is_contiguous() && kv_lens.numel() == x.size(0),
                "FusedModel.forward_block_: kv_lens must be contiguous int64 [M]");
    const int64_t* kl = kv_lens.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (int64_t r = 0; r < x.size(0); ++r)
      TORCH_CHECK(kl[r] > pos[r] && kl[r] <= k_cache.size(3), "FusedModel.forward_block_: kv_len ", kl[r],
                  " not in (position, cache length]");
    run(x, k_cache, v_cache, slots, positions, kl, {});
  }

  // The drafter's context K/V (DFlash-style, runtime/speculation/drafter.py DraftLayer.context_kv):
  // for every layer, [k | v] = feats @ W_kv^T with the k/v rows of the layer's qkv projection
  // (no input norm: feats bf16 [T, d] are already normed), RoPE on k at positions[t], both
  // written to the caches at (slots[t], positions[t]).
  void context_(at::Tensor feats, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots, at::Tensor positions) {
    TORCH_CHECK(feats.dim() == 2 && feats.scalar_type() == at::kBFloat16 && feats.is_contiguous(),
                "FusedModel.context_: feats must be contiguous bf16 [T, d]");
    check(feats.size(0), k_cache, v_cache, slots, positions);
    const int64_t T = feats.size(0), D = k_cache.size(4), L = k_cache.size(3);
    if (T == 0) return;
    const int64_t* sl = slots.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    for (int64_t i = 0; i < static_cast<int64_t>(layers.size()); ++i) {
      const Layer& Ly = layers[i];
      at::Tensor qkv = project(feats, Ly.qkv_t, qtype, Ly.qkv_d, kernel_max_rows);  // q rows computed, unused
      const int64_t W = qkv.size(1);
      float* qp = qkv.data_ptr<float>();
      at::BFloat16* kp = k_cache.select(0, i).data_ptr<at::BFloat16>();
      at::BFloat16* vp = v_cache.select(0, i).data_ptr<at::BFloat16>();
      for (int64_t t = 0; t < T; ++t) {
        float* row = qp + t * W;
        for (int64_t g = 0; g < kv_heads; ++g) rope(row + (heads + g) * D, cp + pos[t] * D, sp + pos[t] * D, D);
        store_kv(row, heads, kv_heads, D, kp, vp, L, sl[t], pos[t]);
      }
    }
  }

 private:
  void check(int64_t M, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
             const at::Tensor& positions) const {
    TORCH_CHECK(k_cache.dim() == 5 && k_cache.scalar_type() == at::kBFloat16 && k_cache.is_contiguous() &&
                    v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kBFloat16 &&
                    v_cache.is_contiguous() && k_cache.size(0) == static_cast<int64_t>(layers.size()) &&
                    k_cache.size(2) == kv_heads,
                "FusedModel: caches must be contiguous bf16 [layers, slots, kv_heads, len, head_dim]");
    const int64_t D = k_cache.size(4);
    TORCH_CHECK(D % 16 == 0 && D <= 128 && cos.size(1) == D, "FusedModel: unsupported head_dim ", D);
    TORCH_CHECK(slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && slots.numel() == M &&
                    positions.numel() == M && slots.is_contiguous() && positions.is_contiguous(),
                "FusedModel: slots and positions must be contiguous int64 [M]");
    const int64_t* sl = slots.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (int64_t r = 0; r < M; ++r) {
      TORCH_CHECK(sl[r] >= 0 && sl[r] < k_cache.size(1), "FusedModel: bad slot ", sl[r]);
      TORCH_CHECK(pos[r] >= 0 && pos[r] < k_cache.size(3) && pos[r] < cos.size(0), "FusedModel: position ", pos[r],
                  " out of range");
    }
  }

  at::Tensor run(at::Tensor& x, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                 const at::Tensor& positions, const int64_t* kv_lens, const std::vector<int64_t>& taps) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                "FusedModel.forward_: x must be contiguous fp32 [M, d]");
    const int64_t M = x.size(0), D = k_cache.size(4);
    check(M, k_cache, v_cache, slots, positions);
    const int64_t* sl = slots.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (int64_t t : taps) TORCH_CHECK(t >= 0 && t < static_cast<int64_t>(layers.size()), "FusedModel.forward_: bad tap");
    at::Tensor tapped = at::empty({M, static_cast<int64_t>(taps.size()), x.size(1)}, x.options());
    if (M == 0) return tapped;
    for (int64_t i = 0; i < static_cast<int64_t>(layers.size()); ++i) {
      const Layer& L = layers[i];
      at::Tensor kc = k_cache.select(0, i), vc = v_cache.select(0, i);
      at::Tensor qkv = project(rms_norm_bf16(x, L.ln1, eps), L.qkv_t, qtype, L.qkv_d, kernel_max_rows);
      at::Tensor attn = attend(qkv, cos, sin, kc, vc, sl, pos, kv_lens, heads, kv_heads, D);
      x.add_(project(attn, L.o_t, qtype, L.o_d, kernel_max_rows));
      at::Tensor gu = project(rms_norm_bf16(x, L.ln2, eps), L.gu_t, qtype, L.gu_d, kernel_max_rows);
      x.add_(project(silu_mul_bf16(gu, gu.size(1) / 2), L.down_t, qtype, L.down_d, kernel_max_rows));
      for (size_t j = 0; j < taps.size(); ++j)
        if (taps[j] == i) tapped.select(1, static_cast<int64_t>(j)).copy_(x);
    }
    return tapped;
  }
};

TORCH_LIBRARY_FRAGMENT(sparkgate, m) {
  m.class_<FusedModel>("FusedModel")
      .def(torch::init<double, int64_t, int64_t, int64_t, int64_t, at::Tensor, at::Tensor>())
      .def("add_layer", &FusedModel::add_layer)
      .def("forward_", &FusedModel::forward_)
      .def("forward_block_", &FusedModel::forward_block_)
      .def("context_", &FusedModel::context_);
}
