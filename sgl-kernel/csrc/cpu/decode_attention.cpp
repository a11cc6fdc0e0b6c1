// Paged decode attention on CPU, reading K/V in place from the token pool.
//
// Why: the torch-native reference gathers every request's K/V into a padded tensor per layer
// (a copy of the whole context, every layer, every step) and then runs SDPA with a mask. Here
// each (request, KV head) task walks its req_to_token row: pass 1 scores the G query heads that
// share the KV head against each K row, then a softmax, then pass 2 accumulates V rows. K and V
// are each read once from the pool, nothing is padded and nothing is copied.
//
// The AVX2 paths keep several independent FMA chains in flight (4 K rows per step in pass 1, 8
// output vectors in pass 2): a single accumulator per dot product would be bound by FMA latency.
// The AVX-512 path (head_dim % 64 == 0, up to 8 query heads per KV head) is specialized on the
// group size so that pass 2 reads each V row once for all G heads, with G x 4 accumulators in
// registers; both passes prefetch the rows a few tokens ahead (the slots are an indirection the
// hardware prefetcher cannot follow).
#include "common.h"
#include "ops.h"

namespace {

constexpr int64_t kTokensPerStep = 4;

template <typename kv_t>
struct TaskArgs {
  const float* q;  // [G, D] query heads of this KV head, row stride q_head_stride
  int64_t q_head_stride;
  const kv_t* k_buf;  // pool [N, Hkv, D], offset to this KV head
  const kv_t* v_buf;
  int64_t kv_row_stride;  // Hkv * D
  const int32_t* slots;  // req_to_token row
  int64_t len, G, D;
  float scale;
  float* out;  // [G, D], row stride out_head_stride
  int64_t out_head_stride;
};

// scores[g * len + t] = scale * q_g . K[slots[t]]
template <typename kv_t>
void score_pass(const TaskArgs<kv_t>& a, float* scores) {
  int64_t t = 0;
#if RS_HAVE_AVX2
  if (a.D % 8 == 0) {
    for (; t + kTokensPerStep <= a.len; t += kTokensPerStep) {
      const kv_t* k[kTokensPerStep];
      for (int j = 0; j < kTokensPerStep; ++j) k[j] = a.k_buf + static_cast<int64_t>(a.slots[t + j]) * a.kv_row_stride;
      for (int64_t g = 0; g < a.G; ++g) {
        const float* q = a.q + g * a.q_head_stride;
        __m256 acc[kTokensPerStep];
        for (int j = 0; j < kTokensPerStep; ++j) acc[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < a.D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(q + d);
          for (int j = 0; j < kTokensPerStep; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(k[j] + d), acc[j]);
        }
        for (int j = 0; j < kTokensPerStep; ++j) scores[g * a.len + t + j] = hsum(acc[j]) * a.scale;
      }
    }
  }
#endif
  for (; t < a.len; ++t) {
    const kv_t* k = a.k_buf + static_cast<int64_t>(a.slots[t]) * a.kv_row_stride;
    for (int64_t g = 0; g < a.G; ++g) scores[g * a.len + t] = dot(a.q + g * a.q_head_stride, k, a.D) * a.scale;
  }
}

// out_g = sum_t p[g * len + t] * V[slots[t]]
template <typename kv_t>
void value_pass(const TaskArgs<kv_t>& a, const float* p, std::vector<float>& acc) {
#if RS_HAVE_AVX2
  constexpr int64_t kChunk = 64;  // 8 accumulators of 8 floats
  if (a.D % kChunk == 0) {
    for (int64_t g = 0; g < a.G; ++g) {
      const float* pg = p + g * a.len;
      for (int64_t d0 = 0; d0 < a.D; d0 += kChunk) {
        __m256 o[8];
        for (int i = 0; i < 8; ++i) o[i] = _mm256_setzero_ps();
        for (int64_t t = 0; t < a.len; ++t) {
          const kv_t* v = a.v_buf + static_cast<int64_t>(a.slots[t]) * a.kv_row_stride + d0;
          const __m256 w = _mm256_set1_ps(pg[t]);
          for (int i = 0; i < 8; ++i) o[i] = _mm256_fmadd_ps(w, load8(v + 8 * i), o[i]);
        }
        float* out = a.out + g * a.out_head_stride + d0;
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + 8 * i, o[i]);
      }
    }
    return;
  }
#endif
  acc.assign(static_cast<size_t>(a.G * a.D), 0.f);
  for (int64_t t = 0; t < a.len; ++t) {
    const kv_t* v = a.v_buf + static_cast<int64_t>(a.slots[t]) * a.kv_row_stride;
    for (int64_t g = 0; g < a.G; ++g) axpy(acc.data() + g * a.D, p[g * a.len + t], v, a.D);
  }
  for (int64_t g = 0; g < a.G; ++g) {
    std::memcpy(a.out + g * a.out_head_stride, acc.data() + g * a.D, sizeof(float) * a.D);
  }
}

#if RS_HAVE_AVX512
// The AVX-512 path is one pass over the tokens in blocks of kBlockTokens with an online softmax
// (flash-decoding): K and V rows of a block are read together, the next block's rows are
// prefetched (the slot indirection defeats the hardware prefetcher), and the block's
// probabilities come from one vector exp. When there are too few (request, KV head) tasks to
// keep every thread busy (a single long request), each request's tokens are split across tasks
// and the partial results merged by their log-sum-exp.
constexpr int64_t kBlockTokens = 16;
constexpr int64_t kMinSplitTokens = 128;

template <typename kv_t>
inline void prefetch_row(const kv_t* row, int64_t n) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(kv_t)); off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

// One block of n <= kBlockTokens tokens for one KV head: folds their scores and values into acc
// [G, D] (un-normalized output), m [G] (running max) and l [G] (running sum of exp(score - m)).
template <int G, typename kv_t>
void block_512(const TaskArgs<kv_t>& a, const int32_t* slots, int n, float* acc, float* m, float* l) {
  constexpr int kNB = G <= 6 ? 4 : 2;  // 16-float chunks per value block: G * kNB accumulators
  const int64_t num_chunks = a.D / 16;
  alignas(64) float p[G][kBlockTokens];
  for (int j = 0; j < n; ++j) {  // scores
    const kv_t* k = a.k_buf + static_cast<int64_t>(slots[j]) * a.kv_row_stride;
    __m512 s[G];
    for (int g = 0; g < G; ++g) s[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < num_chunks; ++c) {
      const __m512 kv = load16(k + 16 * c);
      for (int g = 0; g < G; ++g) s[g] = _mm512_fmadd_ps(_mm512_loadu_ps(a.q + g * a.q_head_stride + 16 * c), kv, s[g]);
    }
    for (int g = 0; g < G; ++g) p[g][j] = _mm512_reduce_add_ps(s[g]) * a.scale;
  }
  const __mmask16 valid = static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1);
  float alpha[G];
  for (int g = 0; g < G; ++g) {  // online softmax: rescale what came before by exp(m_old - m_new)
    const __m512 sv = _mm512_maskz_loadu_ps(valid, p[g]);
    const float m_new = std::max(m[g], _mm512_mask_reduce_max_ps(valid, sv));
    alpha[g] = std::exp(m[g] - m_new);
    const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(m_new))));
    _mm512_store_ps(p[g], e);
    l[g] = l[g] * alpha[g] + _mm512_reduce_add_ps(e);
    m[g] = m_new;
  }
  for (int64_t d0 = 0; d0 < a.D; d0 += 16 * kNB) {  // values
    __m512 o[G][kNB];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kNB; ++c)
        o[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * a.D + d0 + 16 * c), _mm512_set1_ps(alpha[g]));
    for (int j = 0; j < n; ++j) {
      const kv_t* v = a.v_buf + static_cast<int64_t>(slots[j]) * a.kv_row_stride + d0;
      __m512 rows[kNB];
      for (int c = 0; c < kNB; ++c) rows[c] = load16(v + 16 * c);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(p[g][j]);
        for (int c = 0; c < kNB; ++c) o[g][c] = _mm512_fmadd_ps(w, rows[c], o[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kNB; ++c) _mm512_storeu_ps(acc + g * a.D + d0 + 16 * c, o[g][c]);
  }
}

// Tokens [t0, t1) of one (request, KV head) task into acc [G, D], m [G], l [G] (block_512's state),
// prefetching the next block's rows of this head. One task per KV head measured faster than one
// per request reading whole token rows (the per-head working set stays in L1).
template <int G, typename kv_t>
void head_task_512(const TaskArgs<kv_t>& a, int64_t t0, int64_t t1, float* acc, float* m, float* l) {
  for (int g = 0; g < G; ++g) m[g] = -std::numeric_limits<float>::infinity(), l[g] = 0.f;
  std::memset(acc, 0, sizeof(float) * G * a.D);
  for (int64_t tb = t0; tb < t1; tb += kBlockTokens) {
    const int n = static_cast<int>(std::min<int64_t>(kBlockTokens, t1 - tb));
    for (int64_t j = tb + kBlockTokens; j < std::min<int64_t>(tb + 2 * kBlockTokens, t1); ++j) {
      prefetch_row(a.k_buf + static_cast<int64_t>(a.slots[j]) * a.kv_row_stride, a.D);
      prefetch_row(a.v_buf + static_cast<int64_t>(a.slots[j]) * a.kv_row_stride, a.D);
    }
    block_512<G>(a, a.slots + tb, n, acc, m, l);
  }
}

template <typename kv_t>
void head_task_dispatch(const TaskArgs<kv_t>& a, int64_t t0, int64_t t1, float* acc, float* m, float* l) {
  switch (a.G) {
    case 1: return head_task_512<1>(a, t0, t1, acc, m, l);
    case 2: return head_task_512<2>(a, t0, t1, acc, m, l);
    case 3: return head_task_512<3>(a, t0, t1, acc, m, l);
    case 4: return head_task_512<4>(a, t0, t1, acc, m, l);
    case 5: return head_task_512<5>(a, t0, t1, acc, m, l);
    case 6: return head_task_512<6>(a, t0, t1, acc, m, l);
    case 7: return head_task_512<7>(a, t0, t1, acc, m, l);
    default: return head_task_512<8>(a, t0, t1, acc, m, l);
  }
}

bool avx512_applies(int64_t G, int64_t D) { return D % 64 == 0 && G >= 1 && G <= 8; }

// For each query head h of a task: out[h] = sum_s exp(m_s[h] - M) acc_s[h] / sum_s exp(m_s[h] - M)
// l_s[h], M = max_s m_s[h]. part: [S][H * D + 2 * H] (acc, then m, then l); out rows strided.
void merge_splits(const float* part, int64_t S, int64_t H, int64_t D, float* out, int64_t out_head_stride) {
  const int64_t stride = H * D + 2 * H;
  for (int64_t h = 0; h < H; ++h) {
    float M = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < S; ++s) M = std::max(M, part[s * stride + H * D + h]);
    float denom = 0.f;
    float* o = out + h * out_head_stride;
    std::fill(o, o + D, 0.f);
    for (int64_t s = 0; s < S; ++s) {
      const float* ps = part + s * stride;
      if (ps[H * D + H + h] == 0.f) continue;  // an empty split
      const float w = std::exp(ps[H * D + h] - M);
      denom += w * ps[H * D + H + h];
      axpy(o, w, ps + h * D, D);
    }
    const float inv = 1.f / denom;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}
#endif

// The two-pass path (AVX2 or scalar) for one (request, KV head).
template <typename kv_t>
void decode_attention_task(const TaskArgs<kv_t>& a, std::vector<float>& scores, std::vector<float>& acc) {
  scores.resize(static_cast<size_t>(a.G * a.len));
  score_pass(a, scores.data());
  for (int64_t g = 0; g < a.G; ++g) softmax_inplace(scores.data() + g * a.len, a.len);
  value_pass(a, scores.data(), acc);
}

// How many tasks to split each request's tokens into (AVX-512 path): enough (request, KV head,
// split) tasks to balance the threads, none shorter than kMinSplitTokens.
int64_t num_kv_splits(int64_t num_heads_tasks, int64_t max_len) {
  const int64_t want = 4 * at::get_num_threads();
  if (num_heads_tasks >= want) return 1;
  return std::max<int64_t>(1, std::min((want + num_heads_tasks - 1) / num_heads_tasks, max_len / kMinSplitTokens));
}

template <typename kv_t>
void decode_attention_impl(
    const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, at::Tensor& out,
    const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
    double scale, int64_t max_len) {
  const int64_t bs = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_buf.size(1);
  const int64_t G = H / Hkv;
  const float* q_ptr = q.data_ptr<float>();
  const kv_t* k_ptr = k_buf.data_ptr<kv_t>();
  const kv_t* v_ptr = v_buf.data_ptr<kv_t>();
  float* out_ptr = out.data_ptr<float>();
  const int32_t* r2t = req_to_token.data_ptr<int32_t>();
  const int64_t* rows = req_pool_indices.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t r2t_stride = req_to_token.stride(0);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  auto args_of = [&](int64_t b, int64_t kh) {
    return TaskArgs<kv_t>{q_ptr + b * qs0 + kh * G * qs1, qs1, k_ptr + kh * D, v_ptr + kh * D, k_buf.stride(0),
                          r2t + rows[b] * r2t_stride, lens[b], G, D, static_cast<float>(scale),
                          out_ptr + b * os0 + kh * G * os1, os1};
  };
#if RS_HAVE_AVX512
  if (avx512_applies(G, D)) {
    // Tasks are (request, KV head, split); splits only when there are too few of the first two.
    const int64_t S = num_kv_splits(bs * Hkv, max_len), part_stride = G * D + 2 * G;
    std::vector<float> parts(static_cast<size_t>(S > 1 ? bs * Hkv * S * part_stride : 0));
    at::parallel_for(0, bs * Hkv * S, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> own(static_cast<size_t>(part_stride));
      for (int64_t task = begin; task < end; ++task) {
        const int64_t bh = task / S, s = task % S;
        const TaskArgs<kv_t> a = args_of(bh / Hkv, bh % Hkv);
        float* part = S > 1 ? parts.data() + task * part_stride : own.data();
        head_task_dispatch(a, a.len * s / S, a.len * (s + 1) / S, part, part + G * D, part + G * D + G);
        if (S == 1) merge_splits(part, 1, G, D, a.out, a.out_head_stride);
      }
    });
    if (S > 1) {
      at::parallel_for(0, bs * Hkv, 1, [&](int64_t begin, int64_t end) {
        for (int64_t bh = begin; bh < end; ++bh) {
          const TaskArgs<kv_t> a = args_of(bh / Hkv, bh % Hkv);
          merge_splits(parts.data() + bh * S * part_stride, S, G, D, a.out, a.out_head_stride);
        }
      });
    }
    return;
  }
#endif
  at::parallel_for(0, bs * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    for (int64_t task = begin; task < end; ++task) decode_attention_task(args_of(task / Hkv, task % Hkv), scores, acc);
  });
}

}  // namespace

void decode_attention(
    const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, at::Tensor& out,
    const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
    double scale) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3,
              "decode_attention: q/out [bs, H, D], k_buf/v_buf [N, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "decode_attention: q and out must be float32");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type(), "decode_attention: K/V dtypes differ");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "decode_attention: head_dim must be contiguous");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous(), "decode_attention: K/V buffers must be contiguous");
  TORCH_CHECK(k_buf.sizes() == v_buf.sizes() && k_buf.size(2) == q.size(2), "decode_attention: K/V shapes");
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0, "decode_attention: num_heads % num_kv_heads != 0");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.stride(1) == 1,
              "decode_attention: req_to_token must be int32 with contiguous rows");
  TORCH_CHECK(req_pool_indices.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  req_pool_indices.is_contiguous() && seq_lens.is_contiguous(),
              "decode_attention: req_pool_indices and seq_lens must be contiguous int64");
  TORCH_CHECK(req_pool_indices.size(0) == q.size(0) && seq_lens.size(0) == q.size(0),
              "decode_attention: batch sizes differ");
  int64_t max_len = 0;
  for (int64_t b = 0; b < seq_lens.numel(); ++b) {  // a host loop: cheaper than an ATen reduction
    const int64_t len = seq_lens.data_ptr<int64_t>()[b];
    TORCH_CHECK(len >= 1 && len <= req_to_token.size(1), "decode_attention: seq_len ", len, " outside [1, ",
                req_to_token.size(1), "]");
    max_len = std::max(max_len, len);
  }
  if (k_buf.scalar_type() == at::kFloat) {
    decode_attention_impl<float>(q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, scale, max_len);
  } else if (k_buf.scalar_type() == at::kBFloat16) {
    decode_attention_impl<at::BFloat16>(q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens,
                                         scale, max_len);
  } else {
    TORCH_CHECK(false, "decode_attention: K/V must be float32 or bfloat16");
  }
}
