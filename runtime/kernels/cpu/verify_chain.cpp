// Standard-mode speculative verification of a ragged batch in one call
// (torch.ops.sparkgate.verify_chain): the CPU twin of the Triton kernel.
//
// runtime/speculation/verifier.py's verify_chain is the specification, and this op returns
// exactly its tokens (tests/runtime/kernels/test_verify_chain_cpu.py): the same fp32 acceptance
// test, the same residual and the same exact inverse-CDF draw over int64 fixed-point weights
// (runtime/kernels/gpu/reference.py, module docstring, steps 1-4). Every quantity is an fp32
// elementwise result or an exact integer sum, so the order of the loops cannot change a token.
// What it saves is dispatch: the torch version is ~40 small ops per round (gathers, a
// [R, V] residual, quantisation, an int64 cumsum, a binary search), which on a 2-core CPU cost
// ~0.4 ms a round at batch 1 - 6 % of a decode step - and more per verified draft.
//
// Per request r (anchor row t_off[r], draft rows d_off[r] .. d_off[r] + len[r] - 1):
//   draft k (token x) is accepted iff u_accept * p_d(x) < p_t(x) (fp32); a = leading accepted;
//   weights = max(0, p_t - p_d) of row a if a < len (all-zero quantised mass -> p_t), else p_t;
//   next token = smallest i with sum_{j<=i} q_j > floor(u_q * total / 2^24), q = trunc(clamp(w,0,1) * 2^40).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr float kQScale = 1099511627776.0f;  // 2^40 (QUANT_BITS)
constexpr float kUScale = 16777216.0f;       // 2^24 (UNIFORM_BITS)
constexpr int64_t kUMask = (int64_t{1} << 24) - 1;

// trunc(clamp(w, 0, 1) * 2^40): the fp32 product by a power of two is exact.
inline int64_t quantize(float w) {
  const float c = w < 0.0f ? 0.0f : (w > 1.0f ? 1.0f : w);
  return static_cast<int64_t>(c * kQScale);
}

// floor(u_q * total / 2^24) in int64 (reference.py's cdf_threshold).
inline int64_t threshold(float u, int64_t total) {
  int64_t uq = static_cast<int64_t>(u * kUScale);
  uq = std::min(std::max(uq, int64_t{0}), kUMask);
  return (total >> 24) * uq + (((total & kUMask) * uq) >> 24);
}

constexpr int64_t kBlock = 512;  // the draw's two-level search: block sums, then one block

// Quantised weights of a row, p_t (pd == nullptr) or the residual max(0, p_t - p_d) (quantize
// clamps below 0), summed per block of kBlock into `sums`; returns the row total. Branch-free
// inner loops, so they vectorise.
int64_t block_sums(const float* pt, const float* pd, int64_t V, std::vector<int64_t>& sums) {
  const int64_t nb = (V + kBlock - 1) / kBlock;
  sums.assign(nb, 0);
  int64_t total = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * kBlock, hi = std::min(V, lo + kBlock);
    int64_t s = 0;
    if (pd == nullptr) {
      for (int64_t i = lo; i < hi; ++i) s += quantize(pt[i]);
    } else {
      for (int64_t i = lo; i < hi; ++i) s += quantize(pt[i] - pd[i]);
    }
    sums[b] = s;
    total += s;
  }
  return total;
}

// The smallest i whose running sum of quantised weights exceeds t: skip whole blocks by their
// sums, then scan the one block where the sum crosses t (the same i as a scan over the row).
int64_t draw(const float* pt, const float* pd, int64_t V, const std::vector<int64_t>& sums, int64_t t) {
  int64_t cum = 0;
  for (int64_t b = 0; b < static_cast<int64_t>(sums.size()); ++b) {
    if (cum + sums[b] <= t) {
      cum += sums[b];
      continue;
    }
    const int64_t lo = b * kBlock, hi = std::min(V, lo + kBlock);
    for (int64_t i = lo; i < hi; ++i) {
      cum += quantize(pd == nullptr ? pt[i] : pt[i] - pd[i]);
      if (cum > t) return i;
    }
  }
  return V - 1;  // total == 0: an all-zero row (an input error), clamped as the reference does
}

std::tuple<at::Tensor, at::Tensor> verify_chain(const at::Tensor& p_target, const at::Tensor& p_draft,
                                               const at::Tensor& draft_tokens, const at::Tensor& lengths,
                                               const at::Tensor& u_accept, const at::Tensor& u_sample) {
  TORCH_CHECK(p_target.dim() == 2 && p_target.scalar_type() == at::kFloat && p_target.is_contiguous(),
              "p_target: contiguous fp32 [rows, V]");
  TORCH_CHECK(p_draft.dim() == 2 && p_draft.scalar_type() == at::kFloat && p_draft.is_contiguous() &&
                  p_draft.size(1) == p_target.size(1),
              "p_draft: contiguous fp32 [drafts, V]");
  TORCH_CHECK(draft_tokens.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong, "int64 tokens, lengths");
  TORCH_CHECK(u_accept.scalar_type() == at::kFloat && u_sample.scalar_type() == at::kFloat, "fp32 uniforms");
  const int64_t R = lengths.numel(), V = p_target.size(1), D = p_draft.size(0);
  TORCH_CHECK(p_target.size(0) == D + R && draft_tokens.numel() == D && u_accept.numel() == D && u_sample.numel() == R,
              "ragged layout mismatch");
  const auto lens = lengths.contiguous();
  const auto toks = draft_tokens.contiguous();
  const auto ua = u_accept.contiguous();
  const auto us = u_sample.contiguous();
  const int64_t* len = lens.data_ptr<int64_t>();
  std::vector<int64_t> t_off(R), d_off(R);
  for (int64_t r = 0, d = 0; r < R; ++r) {
    TORCH_CHECK(len[r] >= 0, "lengths must be >= 0");
    t_off[r] = d + r;
    d_off[r] = d;
    d += len[r];
    TORCH_CHECK(d <= D, "sum(lengths) exceeds the draft rows");
  }
  at::Tensor accepted = at::zeros({R}, lengths.options());
  at::Tensor next_tokens = at::zeros({R}, lengths.options());
  int64_t* acc = accepted.data_ptr<int64_t>();
  int64_t* nxt = next_tokens.data_ptr<int64_t>();
  const float* pt = p_target.data_ptr<float>();
  const float* pd = D > 0 ? p_draft.data_ptr<float>() : nullptr;
  const int64_t* x = toks.data_ptr<int64_t>();
  const float* u_acc = ua.data_ptr<float>();
  const float* u_smp = us.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int64_t a = 0;
      for (; a < len[r]; ++a) {
        const int64_t d = d_off[r] + a, tok = x[d];
        TORCH_CHECK(tok >= 0 && tok < V, "draft token out of range");
        if (!(u_acc[d] * pd[d * V + tok] < pt[(t_off[r] + a) * V + tok])) break;
      }
      acc[r] = a;
      const float* row = pt + (t_off[r] + a) * V;
      const float* sub = a < len[r] ? pd + (d_off[r] + a) * V : nullptr;  // residual after a rejection
      std::vector<int64_t> sums;
      int64_t total = block_sums(row, sub, V, sums);
      if (total == 0 && sub != nullptr) {  // the residual has no quantised mass: draw from p_t
        sub = nullptr;
        total = block_sums(row, sub, V, sums);
      }
      nxt[r] = draw(row, sub, V, sums, threshold(u_smp[r], total));
    }
  });
  return {accepted, next_tokens};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sparkgate, m) {
  m.def("verify_chain(Tensor p_target, Tensor p_draft, Tensor draft_tokens, Tensor lengths, Tensor u_accept, "
        "Tensor u_sample) -> (Tensor, Tensor)",
        &verify_chain);
}
