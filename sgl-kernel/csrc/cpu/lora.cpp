// The batched LoRA delta: out[t] += (x[t] @ A[s_t]^T) @ B[s_t] for every row t whose adapter slot
// s_t >= 0 (radixserve/lora/kernels.py's contract; slot -1 rows, the base model, are untouched).
//
// Why: the torch paths cost 2-4 ATen ops per projection (a gather, two GEMMs, a mask or a
// scatter), and a decode step runs 7 projections x 30 layers of them, each a few microseconds of
// dispatch around a few thousand FLOPs. This is one call per projection: the rows are sorted by
// slot here, each work item takes up to kMaxRowsPerItem rows of one slot, computes their rank-r
// intermediate into a stack buffer (shrink) and adds its product with B into out (expand), so A
// and B are read once per block of rows and the intermediate never goes to memory.
//
// Parallel over those (slot, block of rows) items: a decode step's rows spread over the slots, a
// prefill's many rows of one slot split into blocks, each item's A and B (rank x (in + out)
// values, ~130 KB fp32 at rank 16 for 576 -> 1536) staying in the core's L2 across its rows.
// Plain loops under `omp simd`: with -march=native they become AVX2 or AVX-512 code alike.
#include <type_traits>

#include "lora.h"

#include "common.h"
#include "ops.h"

namespace {

constexpr int64_t kMaxRowsPerItem = 16;  // rows of one slot per work item
constexpr int64_t kMinRowsPerItem = 4;   // fewer only when a slot has fewer rows
constexpr int64_t kShrinkRows = 4;       // x rows per shrink pass: each A row read once for 4
constexpr int64_t kColBlock = 64;        // output columns accumulated in registers
constexpr int64_t kMaxRank = 512;        // the intermediate lives on the stack

// xa[i * rank + r] = x_i . A[r] for the item's rows (x already fp32).
template <typename w_t>
void shrink(const float* const* xrows, int64_t nrows, const w_t* a, int64_t rank, int64_t d_in, float* xa) {
  for (int64_t r = 0; r < rank; ++r) {
    const w_t* ar = a + r * d_in;
    int64_t i = 0;
    for (; i + kShrinkRows <= nrows; i += kShrinkRows) {
      const float *x0 = xrows[i], *x1 = xrows[i + 1], *x2 = xrows[i + 2], *x3 = xrows[i + 3];
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t k = 0; k < d_in; ++k) {
        const float w = to_float(ar[k]);
        s0 += x0[k] * w;
        s1 += x1[k] * w;
        s2 += x2[k] * w;
        s3 += x3[k] * w;
      }
      xa[i * rank + r] = s0;
      xa[(i + 1) * rank + r] = s1;
      xa[(i + 2) * rank + r] = s2;
      xa[(i + 3) * rank + r] = s3;
    }
    for (; i < nrows; ++i) xa[i * rank + r] = dot(xrows[i], ar, d_in);
  }
}

// acc[0:N] = sum_r xa[r] * B[r, 0:N]; a compile-time N keeps acc in registers.
template <int64_t N, typename w_t>
inline void expand_block(const float* xa, int64_t rank, const w_t* b, int64_t ldb, float* acc) {
  for (int64_t r = 0; r < rank; ++r) {
    const float c = xa[r];
    const w_t* br = b + r * ldb;
#pragma omp simd
    for (int64_t j = 0; j < N; ++j) acc[j] += c * to_float(br[j]);
  }
}

// out_i[j] += delta_i[j], rounded once to out's dtype (bf16: the delta stays fp32 until here).
template <typename out_t>
inline void add_into(out_t* o, const float* acc, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) o[j] = static_cast<out_t>(to_float(o[j]) + acc[j]);
}

template <typename out_t, typename w_t>
void expand(const float* xa, int64_t nrows, int64_t rank, const w_t* b, int64_t d_out, out_t* const* out_rows) {
  for (int64_t j0 = 0; j0 < d_out; j0 += kColBlock) {
    const int64_t width = std::min(kColBlock, d_out - j0);
    for (int64_t i = 0; i < nrows; ++i) {
      alignas(64) float acc[kColBlock] = {};
      if (width == kColBlock) {
        expand_block<kColBlock>(xa + i * rank, rank, b + j0, d_out, acc);
      } else {
        for (int64_t r = 0; r < rank; ++r) axpy(acc, xa[i * rank + r], b + r * d_out + j0, width);
      }
      add_into(out_rows[i] + j0, acc, width);
    }
  }
}

// One (slot, rows) item: rows are token indices into x / out, all of that slot.
template <typename act_t, typename w_t>
void run_item(const act_t* x, int64_t ldx, const w_t* a, const w_t* b, act_t* out, int64_t ldo, const int64_t* rows,
              int64_t nrows, int64_t rank, int64_t d_in, int64_t d_out) {
  const float* xrows[kMaxRowsPerItem] = {};
  act_t* out_rows[kMaxRowsPerItem] = {};
  std::vector<float> x_f32;  // bf16 x widened once, not once per rank
  if constexpr (!std::is_same_v<act_t, float>) x_f32.resize(nrows * d_in);
  for (int64_t i = 0; i < nrows; ++i) {
    const act_t* xi = x + rows[i] * ldx;
    if constexpr (std::is_same_v<act_t, float>) {
      xrows[i] = xi;
    } else {
      float* dst = x_f32.data() + i * d_in;
#pragma omp simd
      for (int64_t k = 0; k < d_in; ++k) dst[k] = to_float(xi[k]);
      xrows[i] = dst;
    }
    out_rows[i] = out + rows[i] * ldo;
  }
  alignas(64) float xa[kMaxRowsPerItem * kMaxRank];  // [nrows, rank]
  shrink(xrows, nrows, a, rank, d_in, xa);
  expand(xa, nrows, rank, b, d_out, out_rows);
}

// The adapted rows sorted by slot (a stable counting sort) and cut into items of at most
// `per_item` rows: enough items to keep every thread busy when the batch allows.
LoraPlan plan(const int64_t* slots, int64_t n, int64_t num_slots) {
  std::vector<int64_t> count(num_slots + 1, 0);
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK_VALUE(slots[t] >= -1 && slots[t] < num_slots, "lora_delta: token_slots[", t, "] = ", slots[t],
                      " is outside [-1, ", num_slots, ")");
    if (slots[t] >= 0) ++count[slots[t] + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) count[s + 1] += count[s];
  const int64_t m = count[num_slots];
  std::vector<int64_t> order(m);
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  for (int64_t t = 0; t < n; ++t)
    if (slots[t] >= 0) order[fill[slots[t]]++] = t;
  const int64_t threads = std::max<int64_t>(1, rs::get_num_threads());
  const int64_t per_item = std::clamp((m + threads - 1) / threads, kMinRowsPerItem, kMaxRowsPerItem);
  std::vector<LoraPlan::Item> items;
  for (int64_t s = 0; s < num_slots; ++s)
    for (int64_t i = count[s]; i < count[s + 1]; i += per_item) items.push_back({s, i, std::min(i + per_item, count[s + 1])});
  return {n, num_slots, std::move(order), std::move(items)};
}

void check_shapes(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  for (const at::Tensor* t : {&x, &a, &b, &out})
    TORCH_CHECK_VALUE(t->device().is_cpu(), "lora_delta: every tensor must be on the CPU");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1, "lora_delta: x must be [n, in] with contiguous rows");
  TORCH_CHECK_VALUE(out.dim() == 2 && out.stride(1) == 1, "lora_delta: out must be [n, out] with contiguous rows");
  TORCH_CHECK_VALUE(x.scalar_type() == out.scalar_type() &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "lora_delta: x and out must both be float32 or both bfloat16, got ", x.scalar_type(), " and ",
                    out.scalar_type());
  TORCH_CHECK_VALUE(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous(),
                    "lora_delta: a [slots, rank, in] and b [slots, rank, out] must be contiguous");
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type() &&
                        (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
                    "lora_delta: a and b must both be float32 or both bfloat16");
  TORCH_CHECK_VALUE(a.size(0) == b.size(0) && a.size(1) == b.size(1),
                    "lora_delta: a and b must have the same slots and rank");
  TORCH_CHECK_VALUE(a.size(1) <= kMaxRank, "lora_delta: rank ", a.size(1), " is above ", kMaxRank);
  TORCH_CHECK_VALUE(a.size(2) == x.size(1) && b.size(2) == out.size(1) && out.size(0) == x.size(0),
                    "lora_delta: x [", x.size(0), ", ", x.size(1), "], a [.., .., ", a.size(2), "], b [.., .., ",
                    b.size(2), "] and out [", out.size(0), ", ", out.size(1), "] do not fit");
}

template <typename act_t, typename w_t>
void apply_typed(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const LoraPlan& p, at::Tensor& out) {
  const int64_t rank = a.size(1), d_in = a.size(2), d_out = b.size(2);
  const act_t* x_ptr = x.data_ptr<act_t>();
  act_t* out_ptr = out.data_ptr<act_t>();
  const w_t* a_ptr = a.data_ptr<w_t>();
  const w_t* b_ptr = b.data_ptr<w_t>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  rs::parallel_for(0, static_cast<int64_t>(p.items.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const LoraPlan::Item& it = p.items[i];
      run_item(x_ptr, ldx, a_ptr + it.slot * rank * d_in, b_ptr + it.slot * rank * d_out, out_ptr, ldo,
               p.order.data() + it.start, it.end - it.start, rank, d_in, d_out);
    }
  });
}

// The dtype dispatch of an applied plan; shapes already checked.
void apply_checked(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const LoraPlan& p, at::Tensor& out) {
  if (p.items.empty() || a.size(1) == 0) return;
  const bool act_f32 = x.scalar_type() == at::kFloat, w_f32 = a.scalar_type() == at::kFloat;
  if (act_f32 && w_f32) return apply_typed<float, float>(x, a, b, p, out);
  if (act_f32) return apply_typed<float, at::BFloat16>(x, a, b, p, out);
  if (w_f32) return apply_typed<at::BFloat16, float>(x, a, b, p, out);
  return apply_typed<at::BFloat16, at::BFloat16>(x, a, b, p, out);
}

}  // namespace

int64_t lora_max_rank() { return kMaxRank; }

LoraPlan lora_plan(const at::Tensor& token_slots, int64_t num_slots) {
  TORCH_CHECK_VALUE(token_slots.device().is_cpu() && token_slots.scalar_type() == at::kLong &&
                        token_slots.dim() == 1 && token_slots.is_contiguous(),
                    "lora_delta: token_slots must be a contiguous int64 [n] on the CPU");
  return plan(token_slots.data_ptr<int64_t>(), token_slots.size(0), num_slots);
}

void lora_apply_(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const LoraPlan& p, at::Tensor& out) {
  check_shapes(x, a, b, out);
  TORCH_CHECK_VALUE(x.size(0) == p.num_rows && a.size(0) == p.num_slots, "lora_delta: a plan for ", p.num_rows,
                    " rows over ", p.num_slots, " slots applied to ", x.size(0), " rows over ", a.size(0));
  apply_checked(x, a, b, p, out);
}

void lora_delta_(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& token_slots,
                 at::Tensor& out) {
  check_shapes(x, a, b, out);
  TORCH_CHECK_VALUE(token_slots.device().is_cpu(), "lora_delta: every tensor must be on the CPU");
  TORCH_CHECK_VALUE(token_slots.scalar_type() == at::kLong && token_slots.dim() == 1 && token_slots.is_contiguous() &&
                        token_slots.size(0) == x.size(0),
                    "lora_delta: token_slots must be a contiguous int64 [n]");
  if (x.size(0) == 0 || a.size(1) == 0) return;
  apply_checked(x, a, b, lora_plan(token_slots, a.size(0)), out);
}
