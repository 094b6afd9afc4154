// CPU matmul over GGUF-quantised weights with the weights entering the arithmetic exactly.
//
//   y[M, N] = x[M, K] @ W[N, K]^T,  W from GGML blocks of 32 along K:
//     Q4_1: w = d * q + m,  q in 0..15, d and m fp16 per block;
//     Q8_0: w = d * q,      q in -128..127, d fp16 per block.
//
// Exactness: q is an integer, converted to bf16 without rounding (|q| <= 128); d and m are
// fp16, converted to fp32 without rounding; per block
//     sum_j w_j x_j = d * (sum_j q_j x_j) + m * (sum_j x_j)
// is formed in fp32 (AVX512-BF16 dot products of bf16 pairs accumulate in fp32). Only the
// activations are bf16 (the serving dtype).
//
// Layout ("tiles", built once at load time by runtime/kernels/cpu/gguf_cpu.py:repack, values
// unchanged): 16 output rows x one 32-wide group form a tile of
//   qs:  the 16 x 32 integers, ordered so that one 512-bit register holds, for a pair of
//        consecutive k, the 16 rows' two values side by side (what VDPBF16PS pairs up):
//        Q4_1 as 8 chunks of 32 bytes whose low nibbles are k-pair 2c and high nibbles
//        k-pair 2c+1 (256 bytes); Q8_0 as 16 chunks of 32 int8 (512 bytes);
//   d:   16 fp16 (32 bytes);  m (Q4_1 only): 16 fp16 (32 bytes).
// Tiles are stored [N/16][K/32] so a thread streams its rows' weights sequentially; the
// bytes per weight equal the GGUF's (20 per 32 for Q4_1, 34 per 32 for Q8_0).
//
// The weights are read once per call whatever M is: each tile is unpacked in registers and
// used for up to 8 rows of x at a time (a tile's bytes stay in L1 for the next 8 rows), so a
// few-token forward (batch decode, speculative verification) costs about one token's memory
// traffic. Lanes are output rows, so no horizontal sums. Parallel over chunks of tiles
// (work_pool.h).
//
// Row invariance: an output's summation order is fixed (see tile_kernel), so row r of an
// M-row call equals the 1-row call bit for bit for every M and work split; a token's result
// does not depend on what else shares its forward (docs/benchmarks.md, "Row invariance").
//
// Built on first use by runtime/kernels/cpu/gguf_cpu.py (torch.utils.cpp_extension); called only
// on CPUs that list avx512_bf16. Registered as torch.ops.sparkgate.gguf_linear.
#include "gguf_cpu.h"
#include "work_pool.h"

#include <ATen/ATen.h>
#include <torch/library.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t QK = 32;           // k per group (GGML block)
constexpr int64_t TN = 16;           // output rows per tile (zmm lanes)
constexpr int64_t QTYPE_Q4_1 = 3;    // GGML type ids (ggml.h)
constexpr int64_t QTYPE_Q8_0 = 8;
constexpr int64_t QTYPE_Q4_1_A8 = 1003;  // not a GGML id: Q4_1 tiles over int8 activations (below)
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 16
#endif

bool& amx_on() {  // AMX for every call, or never (default until Python enables it on an AMX CPU)
  static bool on = false;
  return on;
}

constexpr int64_t tile_bytes(int64_t qtype) { return qtype == QTYPE_Q4_1 ? 256 + 32 + 32 : 512 + 32; }

// bf16 bit patterns of 0..15, twice (VPERMW indexes 32 words with 5 bits).
inline __m512i nibble_lut() {
  alignas(64) uint16_t lut[32];
  for (int i = 0; i < 32; ++i) {
    float f = static_cast<float>(i & 15);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    lut[i] = static_cast<uint16_t>(bits >> 16);  // exact: small integers
  }
  return _mm512_load_si512(lut);
}

inline __m512i bcast_pair(const uint16_t* x) {  // x[0], x[1] (bf16) in every 32-bit lane
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

inline __m512 dp(__m512 acc, __m512i w, __m512i x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
}

// 32 int8 -> 32 bf16 integers (exact).
inline __m512i q8_to_bf16(const uint8_t* p) {
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // lanes 0-15 <- lo, 16-31 <- hi
}

// 32 bf16 (bit patterns) -> two fp32 vectors, elements 0-15 and 16-31 (exact).
inline void bf16x32_to_f32(const uint16_t* p, __m512& lo, __m512& hi) {
  const __m512i v = _mm512_loadu_si512(p);
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
  hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
}

// Row r's 16 outputs of tile t into y (row stride N): fp32, or rounded to bf16.
inline void store_tile_row(__m512 acc, float* y_f32, at::BFloat16* y_bf16, int64_t r, int64_t N, int64_t t) {
  if (y_f32 != nullptr) _mm512_storeu_ps(y_f32 + r * N + t * TN, acc);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(y_bf16 + r * N + t * TN), (__m256i)_mm512_cvtneps_pbh(acc));
}

// Row invariance: every output goes through the same sequence of roundings whatever M, the
// row blocking and the work split are, so row r of an M-row call is bit for bit the 1-row
// call (tests/runtime/kernels/test_row_invariance.py). Per group of 32 k, from zero, chain a
// accumulates the even k-pairs 0, 2, .., 14 and chain b the odd ones 1, 3, .., 15 (one
// VDPBF16PS each); then, group after group, acc = fma(a + b, d, acc) and, for Q4_1,
// acc = fma(m, sum x, acc). A kernel added here must keep this order.
//
// groups_kernel: R rows of x (row stride K) against groups [g0, g0 + GU) of one tile, adding
// into acc[R]. The GU groups' chains are independent, so GU only sets how many are in
// flight: a row alone would wait on VDPBF16PS latency with 2 chains and takes two groups at
// a time (4 chains); 2 and more rows have 4+ chains and share each group's unpacked weights.
// (Measured on a 2-core EPYC, 1 thread, the 30 layers' projections: 1 row 3.6 ms as with the
// earlier 4-chain 1-row kernel, 3 rows 4.9 ms instead of 6.8 ms; 4 groups at a time for one
// row was 20 % slower.)
template <int64_t QTYPE, int R, int GU>
inline __attribute__((always_inline)) void groups_kernel(const uint16_t* x, const float* xsum, const uint8_t* tile,
                                                         int64_t K, int64_t G, int64_t g0, __m512i lut, __m512 (&acc)[R]) {
  constexpr int64_t tb = tile_bytes(QTYPE);
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  __m512 pa[GU][R], pb[GU][R];
  for (int u = 0; u < GU; ++u)
    for (int r = 0; r < R; ++r) pa[u][r] = pb[u][r] = _mm512_setzero_ps();
  for (int u = 0; u < GU; ++u)
    for (int64_t off = 0; off < tb; off += 64)  // PREFETCH_TILES groups ahead
      _mm_prefetch(reinterpret_cast<const char*>(tile + (g0 + u + PREFETCH_TILES) * tb + off), _MM_HINT_T0);
  // Loop orders measured fastest for one row: Q4_1 group after group, Q8_0 (heavier to
  // unpack) the groups' chunks interleaved.
  if (QTYPE == QTYPE_Q4_1) {
    for (int u = 0; u < GU; ++u) {
      for (int c = 0; c < 8; ++c) {  // k = 4c .. 4c+3 of group g0 + u
        const uint8_t* q = tile + (g0 + u) * tb + 32 * c;
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
        const __m512i wa = _mm512_permutexvar_epi16(_mm512_and_si512(b, low4), lut);  // k-pair 2c
        const __m512i wb = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), lut);    // k-pair 2c+1
        const uint16_t* xg = x + (g0 + u) * QK + 4 * c;
        for (int r = 0; r < R; ++r) {
          pa[u][r] = dp(pa[u][r], wa, bcast_pair(xg + r * K));
          pb[u][r] = dp(pb[u][r], wb, bcast_pair(xg + r * K + 2));
        }
      }
    }
  } else {
    for (int c = 0; c < 16; c += 2) {  // k-pairs c, c+1 of each group
      for (int u = 0; u < GU; ++u) {
        const uint8_t* q = tile + (g0 + u) * tb + 32 * c;
        const __m512i wa = q8_to_bf16(q), wb = q8_to_bf16(q + 32);
        const uint16_t* xg = x + (g0 + u) * QK + 2 * c;
        for (int r = 0; r < R; ++r) {
          pa[u][r] = dp(pa[u][r], wa, bcast_pair(xg + r * K));
          pb[u][r] = dp(pb[u][r], wb, bcast_pair(xg + r * K + 2));
        }
      }
    }
  }
  for (int u = 0; u < GU; ++u) {  // in group order
    const uint8_t* t = tile + (g0 + u) * tb;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + (QTYPE == QTYPE_Q4_1 ? 256 : 512))));
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_add_ps(pa[u][r], pb[u][r]), d, acc[r]);
    if (QTYPE == QTYPE_Q4_1) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 288)));
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * G + g0 + u]), acc[r]);
    }
  }
}

// R rows of x against tile t (all its groups, GU at a time); y row stride N.
template <int64_t QTYPE, int R>
void tile_kernel(const uint16_t* x, const float* xsum, const uint8_t* w, float* y_f32, at::BFloat16* y_bf16,
                 int64_t N, int64_t K, int64_t t) {
  constexpr int GU = R == 1 ? 2 : 1;
  const int64_t G = K / QK;
  const uint8_t* tile = w + t * G * tile_bytes(QTYPE);
  const __m512i lut = nibble_lut();
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + GU <= G; g += GU) groups_kernel<QTYPE, R, GU>(x, xsum, tile, K, G, g, lut, acc);
  for (; g < G; ++g) groups_kernel<QTYPE, R, 1>(x, xsum, tile, K, G, g, lut, acc);
  for (int r = 0; r < R; ++r) store_tile_row(acc[r], y_f32, y_bf16, r, N, t);
}

// Row chunking: the rows of a call go through a tile in as few passes of at most 8 rows as
// possible, the passes balanced (9 rows: 5 + 4). row_chunk runs fn(std::integral_constant<int,
// R>) for the next pass and returns R. Each pass unpacks the tile again, and a 1-row pass is
// bound by that unpacking: with the former chunks of 8 / 4 / 3 / 2 / 1, a 1 + 4-row
// verification forward ran 4 + 1 rows and cost 1.70 decode steps; in one pass of 5, 1.48
// (medians of 6 interleaved process pairs, EPYC with AVX512-BF16, 2 threads, context 256;
// docs/benchmarks.md "One pass per 8 rows"). Every R keeps the per-row summation order, so the
// chunking does not change a bit of the output.
constexpr int64_t MAX_ROWS_PER_PASS = 8;
template <typename Fn>
inline int64_t row_chunk(int64_t left, Fn&& fn) {
  const int64_t passes = (left + MAX_ROWS_PER_PASS - 1) / MAX_ROWS_PER_PASS;
  switch ((left + passes - 1) / passes) {
    case 8: fn(std::integral_constant<int, 8>{}); return 8;
    case 7: fn(std::integral_constant<int, 7>{}); return 7;
    case 6: fn(std::integral_constant<int, 6>{}); return 6;
    case 5: fn(std::integral_constant<int, 5>{}); return 5;
    case 4: fn(std::integral_constant<int, 4>{}); return 4;
    case 3: fn(std::integral_constant<int, 3>{}); return 3;
    case 2: fn(std::integral_constant<int, 2>{}); return 2;
    default: fn(std::integral_constant<int, 1>{}); return 1;
  }
}

// ---- int8 activations (QTYPE_Q4_1_A8) ------------------------------------------------
// W4A8, as llama.cpp multiplies Q4 weights by Q8 activations: each row's activations are
// quantised per group of 32 k to int8 with one fp32 scale (sx = max|x| / 127, xq = x / sx
// rounded to nearest even), and VPDPBUSD multiplies the unsigned 4-bit q by the signed xq,
// 64 products per instruction where VDPBF16PS does 32 — a verified row or a batched request
// costs about half as much. Per group
//     sum_j w_j x^_j = (d * sx) * (sum_j q_j xq_j) + m * xs,   x^_j = sx * xq_j, xs = sx * sum_j xq_j,
// so the weights stay exact and the result is the exact product with the quantised
// activations x^ up to fp32 rounding. The integer sums are exact in any order; per group
// the fp32 steps are acc = fma(float(isum), d * sx, acc), then acc = fma(m, xs, acc), in
// group order for every M: row invariance holds as for the bf16 kernel.
//
// A chunk c of a Q4_1 tile holds, as 16 little-endian words (one per output row), the
// nibbles of k = 4c (low of byte 0), 4c+1 (low of byte 1), 4c+2 (high of byte 0), 4c+3
// (high of byte 1): widened to 32-bit lanes, (v & 0x0F0F) | ((v << 12) & 0x0F0F0000) puts
// k = 4c..4c+3 in bytes 0..3 of each output's lane, VPDPBUSD's layout.
template <int R, int GU>
inline __attribute__((always_inline)) void groups_kernel_a8(const int8_t* xq, const float* sx, const float* xs,
                                                            const uint8_t* tile, int64_t K, int64_t G, int64_t g0,
                                                            __m512 (&acc)[R]) {
  constexpr int64_t tb = tile_bytes(QTYPE_Q4_1);
  const __m512i lo = _mm512_set1_epi32(0x0F0F), hi = _mm512_set1_epi32(0x0F0F0000);
  __m512i sa[GU][R], sb[GU][R];  // even and odd chunks: two independent chains per group
  for (int u = 0; u < GU; ++u)
    for (int r = 0; r < R; ++r) sa[u][r] = sb[u][r] = _mm512_setzero_si512();
  for (int u = 0; u < GU; ++u)
    for (int64_t off = 0; off < tb; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(tile + (g0 + u + PREFETCH_TILES) * tb + off), _MM_HINT_T0);
  for (int u = 0; u < GU; ++u) {
    for (int c = 0; c < 8; c += 2) {
      const uint8_t* q = tile + (g0 + u) * tb + 32 * c;
      const __m512i va = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
      const __m512i vb = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32)));
      const __m512i wa = _mm512_or_si512(_mm512_and_si512(va, lo), _mm512_and_si512(_mm512_slli_epi32(va, 12), hi));
      const __m512i wb = _mm512_or_si512(_mm512_and_si512(vb, lo), _mm512_and_si512(_mm512_slli_epi32(vb, 12), hi));
      const int8_t* xg = xq + (g0 + u) * QK + 4 * c;
      for (int r = 0; r < R; ++r) {
        int32_t xa, xb;
        std::memcpy(&xa, xg + r * K, 4);
        std::memcpy(&xb, xg + r * K + 4, 4);
        sa[u][r] = _mm512_dpbusd_epi32(sa[u][r], wa, _mm512_set1_epi32(xa));
        sb[u][r] = _mm512_dpbusd_epi32(sb[u][r], wb, _mm512_set1_epi32(xb));
      }
    }
  }
  for (int u = 0; u < GU; ++u) {  // in group order
    const uint8_t* t = tile + (g0 + u) * tb;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 256)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 288)));
    for (int r = 0; r < R; ++r) {
      const __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(sa[u][r], sb[u][r]));  // exact: |isum| <= 32*15*127
      acc[r] = _mm512_fmadd_ps(isum, _mm512_mul_ps(d, _mm512_set1_ps(sx[r * G + g0 + u])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * G + g0 + u]), acc[r]);
    }
  }
}

template <int R>
void tile_kernel_a8(const int8_t* xq, const float* sx, const float* xs, const uint8_t* w, float* y_f32,
                    at::BFloat16* y_bf16, int64_t N, int64_t K, int64_t t) {
  constexpr int GU = R == 1 ? 2 : 1;
  const int64_t G = K / QK;
  const uint8_t* tile = w + t * G * tile_bytes(QTYPE_Q4_1);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + GU <= G; g += GU) groups_kernel_a8<R, GU>(xq, sx, xs, tile, K, G, g, acc);
  for (; g < G; ++g) groups_kernel_a8<R, 1>(xq, sx, xs, tile, K, G, g, acc);
  for (int r = 0; r < R; ++r) store_tile_row(acc[r], y_f32, y_bf16, r, N, t);
}

void tiles_all_rows_a8(const int8_t* xq, const float* sx, const float* xs, const uint8_t* w, float* y_f32,
                       at::BFloat16* y_bf16, int64_t M, int64_t N, int64_t K, int64_t t0, int64_t t1) {
  const int64_t G = K / QK;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t i = 0; i < M;) {
      const int8_t* xi = xq + i * K;
      const float *si = sx + i * G, *ss = xs + i * G;
      float* yf = y_f32 != nullptr ? y_f32 + i * N : nullptr;
      at::BFloat16* yb = y_bf16 != nullptr ? y_bf16 + i * N : nullptr;
      i += row_chunk(M - i, [&](auto r) { tile_kernel_a8<decltype(r)::value>(xi, si, ss, w, yf, yb, N, K, t); });
    }
}

// bf16 [M, K] -> int8 xq [M, K], scales sx [M, G] and xs = sx * sum(xq) [M, G] (see above).
void quantize_rows_a8(const uint16_t* x, int8_t* xq, float* sx, float* xs, int64_t M, int64_t K) {
  const int64_t G = K / QK;
  for (int64_t i = 0; i < M * G; ++i) {
    __m512 a, b;
    bf16x32_to_f32(x + i * QK, a, b);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));  // nearest even
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i * QK), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i * QK + 16), _mm512_cvtsepi32_epi8(qb));
    sx[i] = s;
    xs[i] = s * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
  }
}

// ---- AMX path ---------------------------------------------------------------------------
// The VDPBF16PS path pays one instruction per row per 32 weights. With AMX one TDPBF16PS
// multiplies up to 16 rows of x by a whole unpacked tile (16 outputs x 32 k): the tile's
// k-pair registers are exactly the B operand's VNNI rows. Per group the 16x16 fp32 product
// is stored and scaled by d (and Q4_1's m * sum x) into the accumulators, which keeps the
// weights exact as above. Each row of the product is the same whatever rows share the tile,
// but its rounding differs from the VDPBF16PS chains: for row invariance a CPU uses AMX for
// every call, 1-row decode steps included, or for none (set_amx).

struct TileConfig {  // the LDTILECFG memory layout (palette 1)
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_usable() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// One group's 16 k-pairs x 16 outputs of a tile, unpacked to bf16 in the B operand's layout.
template <int64_t QTYPE>
inline void unpack_b(const uint8_t* tile, uint16_t* bbuf, __m512i lut, __m512i low4) {
  if (QTYPE == QTYPE_Q4_1) {
    for (int c = 0; c < 8; ++c) {
      __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * c)));
      _mm512_store_si512(bbuf + 64 * c, _mm512_permutexvar_epi16(_mm512_and_si512(b, low4), lut));
      _mm512_store_si512(bbuf + 64 * c + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), lut));
    }
  } else {
    for (int c = 0; c < 16; ++c) _mm512_store_si512(bbuf + 32 * c, q8_to_bf16(tile + 32 * c));
  }
}

// One group's product for up to 16 rows: C = A (rows of x, this group's 32 k) x B (unpacked
// weights), then acc[r] += C[r] * d (+ Q4_1's m * sum x), groups in order.
template <int64_t QTYPE>
inline void amx_group(const uint16_t* x, int64_t K, const uint16_t* bbuf, const uint8_t* tile, const float* xsum,
                      int64_t G, int64_t g, int64_t M, float* cbuf, __m512* acc) {
  _tile_zero(0);
  _tile_loadd(1, x + g * QK, K * 2);
  _tile_loadd(2, bbuf, 64);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, cbuf, 64);
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + (QTYPE == QTYPE_Q4_1 ? 256 : 512))));
  if (QTYPE == QTYPE_Q4_1) {
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 288)));
    for (int64_t r = 0; r < M; ++r)
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * G + g]), _mm512_fmadd_ps(_mm512_load_ps(cbuf + 16 * r), d, acc[r]));
  } else {
    for (int64_t r = 0; r < M; ++r) acc[r] = _mm512_fmadd_ps(_mm512_load_ps(cbuf + 16 * r), d, acc[r]);
  }
}

inline void amx_config(int64_t rows) {
  TileConfig cfg;
  cfg.rows[0] = cfg.rows[1] = static_cast<uint8_t>(rows);  // C: rows x 16 fp32, A: rows x 32 bf16
  cfg.rows[2] = 16;                                        // B: 16 k-pairs x 32 bf16
  cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[2] = 64;
  _tile_loadconfig(&cfg);
}

// Up to 16 rows (a decode step, a small verification): each group unpacked as it is used.
template <int64_t QTYPE>
void tile_kernel_amx(const uint16_t* x, const float* xsum, const uint8_t* w, float* y_f32, at::BFloat16* y_bf16,
                     int64_t M, int64_t N, int64_t K, int64_t t0, int64_t t1) {
  const int64_t G = K / QK;
  const int64_t tb = tile_bytes(QTYPE);
  amx_config(M);
  alignas(64) uint16_t bbuf[16 * 32];
  alignas(64) float cbuf[16 * 16];
  const __m512i lut = nibble_lut();
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  __m512 acc[16];
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * G * tb;
    for (int64_t r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g, tile += tb) {
      for (int64_t off = 0; off < tb; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(tile + PREFETCH_TILES * tb + off), _MM_HINT_T0);
      unpack_b<QTYPE>(tile, bbuf, lut, low4);
      amx_group<QTYPE>(x, K, bbuf, tile, xsum, G, g, M, cbuf, acc);
    }
    for (int64_t r = 0; r < M; ++r) store_tile_row(acc[r], y_f32, y_bf16, r, N, t);
  }
  _tile_release();
}

// More than 16 rows (verification under load, prefill chunks): a tile's groups are unpacked
// once (G KB, in L1/L2) and every 16-row chunk multiplies them, where 16-row calls would
// unpack them once per chunk. x (and xsum) hold M rows zero-padded to a multiple of 16
// (gguf_linear), so every chunk runs as 16 rows; a row's product does not depend on the
// tile's other rows, and the groups reach its accumulators in the same order, so every row
// is bit for bit what the 16-row kernel above gives it (tests/runtime/kernels/test_row_invariance.py).
template <int64_t QTYPE>
void tile_kernel_amx_many(const uint16_t* x, const float* xsum, const uint8_t* w, float* y_f32, at::BFloat16* y_bf16,
                          int64_t M, int64_t N, int64_t K, int64_t t0, int64_t t1) {
  const int64_t G = K / QK;
  const int64_t tb = tile_bytes(QTYPE);
  amx_config(16);
  alignas(64) float cbuf[16 * 16];
  // the tile's G groups unpacked (G KB: 18 KB at K = 576, 48 KB at 1,536), 64-byte aligned
  std::unique_ptr<uint16_t, decltype(&std::free)> unpacked(
      static_cast<uint16_t*>(std::aligned_alloc(64, G * 16 * 32 * sizeof(uint16_t))), &std::free);
  uint16_t* bball = unpacked.get();
  const __m512i lut = nibble_lut();
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  __m512 acc[16];
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile0 = w + t * G * tb;
    const uint8_t* tile = tile0;
    for (int64_t g = 0; g < G; ++g, tile += tb) {
      for (int64_t off = 0; off < tb; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(tile + PREFETCH_TILES * tb + off), _MM_HINT_T0);
      unpack_b<QTYPE>(tile, bball + g * 512, lut, low4);
    }
    for (int64_t i = 0; i < M; i += 16) {
      const int64_t rows = std::min<int64_t>(16, M - i);  // the tile multiplies 16; only these are scaled and stored
      const float* si = xsum != nullptr ? xsum + i * G : nullptr;
      for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
      tile = tile0;
      for (int64_t g = 0; g < G; ++g, tile += tb) amx_group<QTYPE>(x + i * K, K, bball + g * 512, tile, si, G, g, rows, cbuf, acc);
      for (int64_t r = 0; r < rows; ++r)
        store_tile_row(acc[r], y_f32 != nullptr ? y_f32 + i * N : nullptr, y_bf16 != nullptr ? y_bf16 + i * N : nullptr, r, N, t);
    }
  }
  _tile_release();
}

// All M rows against tiles [t0, t1).
template <int64_t QTYPE>
void tiles_all_rows(const uint16_t* x, const float* xsum, const uint8_t* w, float* y_f32, at::BFloat16* y_bf16,
                    int64_t M, int64_t N, int64_t K, int64_t t0, int64_t t1, bool amx) {
  const int64_t G = K / QK;
  if (amx) {  // up to 16 rows in one pass through the tile unit; more in 16-row chunks over weights unpacked once
    if (M <= 16) tile_kernel_amx<QTYPE>(x, xsum, w, y_f32, y_bf16, M, N, K, t0, t1);
    else tile_kernel_amx_many<QTYPE>(x, xsum, w, y_f32, y_bf16, M, N, K, t0, t1);
    return;
  }
  // Tile by tile (its bytes stay in L1 between row chunks): rows in chunks of 8, the last
  // 1-7 rows in one pass (row_chunk).
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t i = 0; i < M;) {
      const uint16_t* xi = x + i * K;
      const float* xs = xsum != nullptr ? xsum + i * G : nullptr;
      float* yf = y_f32 != nullptr ? y_f32 + i * N : nullptr;
      at::BFloat16* yb = y_bf16 != nullptr ? y_bf16 + i * N : nullptr;
      i += row_chunk(M - i, [&](auto r) { tile_kernel<QTYPE, decltype(r)::value>(xi, xs, w, yf, yb, N, K, t); });
    }
}

}  // namespace

// x: bf16 [M, K]; tiles: uint8 [N/16, K/32, tile bytes] (repacked GGML blocks); returns
// [M, N] in out_dtype (float32 or bfloat16).
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t qtype, int64_t N, int64_t K,
                       at::ScalarType out_dtype) {
  TORCH_CHECK(qtype == QTYPE_Q4_1 || qtype == QTYPE_Q8_0 || qtype == QTYPE_Q4_1_A8,
              "gguf_linear: qtype must be Q4_1 (3), Q8_0 (8) or Q4_1 over int8 activations (1003)");
  const bool a8 = qtype == QTYPE_Q4_1_A8;
  if (a8) qtype = QTYPE_Q4_1;  // the same tiles
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "gguf_linear: x must be [M, ", K, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "gguf_linear: x must be bfloat16");
  TORCH_CHECK(K % QK == 0 && N % TN == 0, "gguf_linear: K must be a multiple of 32 and N of 16");
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous() &&
                  tiles.numel() == (N / TN) * (K / QK) * tile_bytes(qtype),
              "gguf_linear: tiles must be contiguous uint8 of N/16 * K/32 * ", tile_bytes(qtype), " bytes");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "gguf_linear: out dtype float32 or bfloat16");
  at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  const int64_t G = K / QK;
  at::Tensor y = at::empty({M, N}, x.options().dtype(out_dtype));
  if (M == 0 || N == 0) return y;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const uint8_t* wp = tiles.data_ptr<uint8_t>();
  float* yf = out_dtype == at::kFloat ? y.data_ptr<float>() : nullptr;
  at::BFloat16* yb = out_dtype == at::kBFloat16 ? y.data_ptr<at::BFloat16>() : nullptr;
  const int64_t T = N / TN;
  auto& pool = sparkgate::WorkPool::instance();
  const int64_t per = std::max<int64_t>(2, T / (8 * pool.threads()));  // tiles per chunk
  if (a8) {
    std::vector<int8_t> xq(M * K);
    std::vector<float> sx(M * G), xs(M * G);
    quantize_rows_a8(xp, xq.data(), sx.data(), xs.data(), M, K);
    pool.run((T + per - 1) / per, [&](int64_t c) {
      tiles_all_rows_a8(xq.data(), sx.data(), xs.data(), wp, yf, yb, M, N, K, c * per, std::min(T, c * per + per));
    });
    return y;
  }
  // Per-group sums of the bf16 activations (fp32), for Q4_1's offset term m * sum_j x_j.
  std::vector<float> xsum;
  if (qtype == QTYPE_Q4_1) {
    xsum.resize(M * G);
    for (int64_t i = 0; i < M * G; ++i) {
      __m512 lo, hi;
      bf16x32_to_f32(xp + i * QK, lo, hi);
      xsum[i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  }
  const bool amx = amx_on() && amx_usable();
  std::vector<uint16_t> xpad;  // AMX beyond 16 rows: the rows zero-padded to a multiple of 16 (tile_kernel_amx_many)
  if (amx && M > 16 && M % 16 != 0) {
    const int64_t Mp = (M + 15) / 16 * 16;
    xpad.assign(Mp * K, 0);
    std::memcpy(xpad.data(), xp, M * K * sizeof(uint16_t));
    xp = xpad.data();
    if (qtype == QTYPE_Q4_1) xsum.resize(Mp * G, 0.f);
  }
  const float* xs = qtype == QTYPE_Q4_1 ? xsum.data() : nullptr;
  pool.run((T + per - 1) / per, [&](int64_t c) {
    const int64_t t0 = c * per, t1 = std::min(T, t0 + per);
    if (qtype == QTYPE_Q4_1) tiles_all_rows<QTYPE_Q4_1>(xp, xs, wp, yf, yb, M, N, K, t0, t1, amx);
    else tiles_all_rows<QTYPE_Q8_0>(xp, xs, wp, yf, yb, M, N, K, t0, t1, amx);
  });
  return y;
}

void set_kernel_threads(int64_t n) { sparkgate::WorkPool::instance().set_threads(static_cast<int>(n)); }

// Whether gguf_linear (and the fused attention) use AMX, for every row count. Set from
// Python where the CPU has it.
void set_amx(bool on) { amx_on() = on; }

bool gguf_amx_enabled() { return amx_on(); }

int64_t kernel_threads() { return sparkgate::WorkPool::instance().threads(); }

TORCH_LIBRARY(sparkgate, m) {
  m.def("gguf_linear(Tensor x, Tensor tiles, int qtype, int N, int K, ScalarType out_dtype) -> Tensor");
  m.def("set_kernel_threads(int n) -> ()", &set_kernel_threads);
  m.def("set_amx(bool on) -> ()", &set_amx);
  m.def("amx_enabled() -> bool", &gguf_amx_enabled);
  m.def("kernel_threads() -> int", &kernel_threads);
}

TORCH_LIBRARY_IMPL(sparkgate, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
}
