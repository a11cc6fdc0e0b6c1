// The greedy sampler's argmax over each row of the logits: torch.argmax(x, dim=-1)'s answer (the
// first index of the row's maximum, a NaN counting as greater than every number), vectorized.
//
// Why: torch's CPU argmax walks the row one element at a time: 0.2-0.4 ms of a Zen 3 core for
// Qwen3's 151,936-entry vocabulary at every greedy decode step, ~5 ms for 64 rows of the built-in
// model's 49,152 (benchmark/bench_argmax.py; the whole step is 5-15 ms at one row, ~100 ms at
// 64). Here four chains of eight lanes each keep their lane's maximum and the first index where
// it was seen; the lanes are then reduced by value, ties to the lowest index.
//
// argmax_rows_checked also says which rows' chosen logit is not finite (a NaN row, every token
// masked to -inf, a +inf): the greedy sampler's whole guard in the same pass, where the Python
// guard took 11 small torch ops, each slow right after the forward has streamed the weights
// through the caches (benchmark/bench_cold_ops.py; docs/cpu_backend.md, "Host work around a step").
#include "common.h"
#include "ops.h"

namespace {

// The first index of the first NaN in x[0, n), or -1.
int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

// The first index of the maximum of x[0, n) (n > 0), x holding no NaN.
int64_t first_max_scalar(const float* x, int64_t from, int64_t n, int64_t best) {
  for (int64_t i = from; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

#if RS_HAVE_AVX2
constexpr int kChains = 4;
constexpr int64_t kStep = 8 * kChains;

// The first index of the maximum of x[0, n) (n >= kStep); -1 when the row holds a NaN (the caller
// then finds the first one).
int64_t first_max_avx2(const float* x, int64_t n) {
  __m256 best[kChains];
  __m256i at[kChains];
  __m256 nan = _mm256_setzero_ps();
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int c = 0; c < kChains; ++c) {
    best[c] = _mm256_loadu_ps(x + 8 * c);
    at[c] = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * c));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(best[c], best[c], _CMP_UNORD_Q));
  }
  int64_t i = kStep;
  for (; i + kStep <= n; i += kStep)
    for (int c = 0; c < kChains; ++c) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * c);
      // Strictly greater: a lane keeps the first index of its maximum.
      const __m256 gt = _mm256_cmp_ps(v, best[c], _CMP_GT_OQ);
      best[c] = _mm256_blendv_ps(best[c], v, gt);
      const __m256i idx = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(i + 8 * c)));
      at[c] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at[c]), _mm256_castsi256_ps(idx), gt));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
  if (_mm256_movemask_ps(nan) != 0) return -1;
  alignas(32) float value[kStep];
  alignas(32) int32_t index[kStep];
  for (int c = 0; c < kChains; ++c) {
    _mm256_store_ps(value + 8 * c, best[c]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(index + 8 * c), at[c]);
  }
  int64_t winner = index[0];
  for (int l = 1; l < kStep; ++l)
    if (value[l] > x[winner] || (value[l] == x[winner] && index[l] < winner)) winner = index[l];
  for (int64_t j = i; j < n; ++j)
    if (std::isnan(x[j])) return -1;
  return first_max_scalar(x, i, n, winner);
}
#endif

int64_t row_argmax(const float* x, int64_t n) {
#if RS_HAVE_AVX2
  // Indices are int32 lanes: rows longer than that (never a vocabulary) take the scalar loop.
  if (n >= kStep && n <= std::numeric_limits<int32_t>::max()) {
    const int64_t best = first_max_avx2(x, n);
    return best >= 0 ? best : first_nan(x, n);
  }
#endif
  const int64_t nan_at = first_nan(x, n);
  return nan_at >= 0 ? nan_at : first_max_scalar(x, 1, n, 0);
}

}  // namespace

namespace {

void check_logits(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, name,
              ": x must be a CPU float32 [rows, n] with contiguous rows, got ", x.scalar_type(), " ", x.sizes(),
              " strides ", x.strides());
  TORCH_CHECK(x.size(1) > 0, name, ": rows of zero elements have no argmax");
}

// Each row's argmax into ids; with `invalid`, also whether the chosen logit is not finite.
void argmax_into(const at::Tensor& x, int64_t* ids, bool* invalid) {
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  const float* base = x.data_ptr<float>();
  // Tasks of at least ~1M elements (~0.1-0.2 ms): a decode step's one row stays on its thread.
  rs::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 20) / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = base + r * ld;
      ids[r] = row_argmax(row, n);
      if (invalid != nullptr) invalid[r] = !std::isfinite(row[ids[r]]);
    }
  });
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
  check_logits(x, "argmax_rows");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  argmax_into(x, out.data_ptr<int64_t>(), nullptr);
  return out;
}

std::tuple<at::Tensor, at::Tensor> argmax_rows_checked(const at::Tensor& logits) {
  // Any layout and float dtype: the caller then tests only the device (each test is a Python-to-
  // torch call, cold right after a forward). The usual fp32 rows pass through untouched.
  const at::Tensor x = logits.dim() == 2 ? logits.to(at::kFloat).contiguous() : logits;
  check_logits(x, "argmax_rows_checked");
  at::Tensor ids = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  at::Tensor invalid = at::empty({x.size(0)}, x.options().dtype(at::kBool));
  argmax_into(x, ids.data_ptr<int64_t>(), invalid.data_ptr<bool>());
  return {ids, invalid};
}
