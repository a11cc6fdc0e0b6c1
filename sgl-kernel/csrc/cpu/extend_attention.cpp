// Paged extend (prefill) attention on CPU, reading K/V in place from the token pool.
//
// Why: the torch-native path gathers each request's whole K/V context out of the pool and runs one
// SDPA call per request, with an explicit [q_len, seq_len] mask whenever the request has a cached
// prefix (SDPA's fast causal kernel only covers q_len == kv_len). Here it is flash attention:
// - A work item is (request, KV head, block of query positions). Its query rows of every head in
//   the GQA group are packed together (e.g. 32 positions x 3 heads = 96 rows), so each block of
//   keys read from the pool serves the whole group.
// - Keys come in blocks of 64, gathered through req_to_token into a small transposed K tile and a
//   V tile (extend_attention_tile.h); S = Q K^T and O = O * alpha + P V are register-blocked
//   AVX-512 (or AVX2) products, with an online softmax in between.
// - Causality: a query at position p sees keys 0..p, so key blocks past the item's last position
//   are never visited and only the blocks on the diagonal are masked, row by row.
// - bf16 pools on AVX512_BF16 builds run the same loop on vdpbf16ps tiles (extend_attention_bf16.h:
//   q * scale and the softmax weights rounded to bf16, fp32 accumulation); other pools, fp32 tiles.
// - A draft tree (speculative decoding) passes a mask among each request's new tokens: query i sees
//   the whole cached prefix and the new tokens j with mask[i][j] set (its ancestors and itself, so
//   j <= i). Then only the prefix is visited unmasked; keys from the first new token on are masked
//   per row through the tree mask instead of the causal diagonal.
// - Items are scheduled heaviest first (later query blocks see more keys) onto threads that each
//   take the next item when done.
#include "extend_attention_bf16.h"
#include "extend_attention_tile.h"
#include "ops.h"

#include <atomic>
#include <type_traits>

namespace {

#if RS_HAVE_AVX2
using namespace extend_tile;

constexpr int64_t kTargetRows = 96;  // query rows (positions x group heads) per work item

struct WorkItem {
  int64_t b, kh, p0, nq;  // request, KV head, first query of the block (within the extend), count
  int64_t cost;           // rows x keys visited: the order of scheduling
};

template <typename T>
void grow(std::vector<T>& x, int64_t n) {
  if (static_cast<int64_t>(x.size()) < n) x.resize(static_cast<size_t>(n));
}

struct Buffers {  // per thread, grown to the largest item seen
  std::vector<float> q, s, o, kt, v, m, l, alpha;
  std::vector<uint32_t> qb, kb, vb, pb;  // the bf16-dot tiles (extend_attention_bf16.h): bf16 pairs
  void reserve(int64_t M, int64_t Dp, bool bf16_dot) {
    grow(s, M * kKeys), grow(o, M * Dp), grow(m, M), grow(l, M), grow(alpha, M);
    if (!bf16_dot) {
      grow(q, M * Dp), grow(kt, Dp * kKeys), grow(v, kKeys * Dp);
      return;
    }
#if RS_HAVE_EXTEND_BF16
    grow(qb, M * pairs(Dp)), grow(kb, key_pair_rows(Dp) * kKeys), grow(vb, kKeys / 2 * Dp), grow(pb, M * kKeys / 2);
#endif
  }
};

// Whether a pool of kv_t runs the bf16-dot tiles: bf16 pools, where this build has AVX512_BF16.
template <typename kv_t>
constexpr bool kBf16Dot = RS_HAVE_EXTEND_BF16 && std::is_same_v<kv_t, at::BFloat16>;

template <typename kv_t>
struct Problem {
  const float* q;
  int64_t qs0, qs1;  // q strides (token, head); head_dim is contiguous
  const kv_t* k;
  const kv_t* v;
  int64_t kv_row_stride;  // Hkv * D
  const float* k_scale = nullptr;  // int8 pools: [N, Hkv] per-row scales; else nullptr
  const float* v_scale = nullptr;
  float* out;             // [T, H * D]
  std::vector<const int32_t*> rows;
  std::vector<int64_t> q_start, prefix, ext;
  std::vector<const uint8_t*> tree;  // per request its [ext, ext] mask among new tokens, or empty
  int64_t H, Hkv, G, D, Dp;
  float scale;
};

// S = (scale Q) K^T over one block of n keys at slots[0..n) (nc: n rounded up to whole registers).
template <typename kv_t>
void scores_block(const Problem<kv_t>& pb, const kv_t* k, const float* k_scale, const int32_t* slots, int64_t n,
                  int64_t nc, int64_t M, Buffers& buf) {
#if RS_HAVE_EXTEND_BF16
  if constexpr (kBf16Dot<kv_t>) {
    pack_keys_t_bf16(k, pb.kv_row_stride, slots, n, pb.D, buf.kb.data());
    tile_gemm_bf16<false>(buf.qb.data(), pairs(pb.Dp), buf.kb.data(), kKeys, pairs(pb.Dp), buf.s.data(), kKeys, M,
                          nc, nullptr);
    return;
  }
#endif
  pack_keys_t(k, pb.kv_row_stride, k_scale, pb.Hkv, slots, n, pb.D, pb.Dp, buf.kt.data());
  tile_gemm<false>(buf.q.data(), pb.Dp, buf.kt.data(), kKeys, pb.Dp, buf.s.data(), kKeys, M, nc, nullptr);
}

// O = O * alpha + P V over the same block (the first block: O = P V), P the block's weights in buf.s.
template <typename kv_t>
void values_block(const Problem<kv_t>& pb, const kv_t* v, const float* v_scale, const int32_t* slots, int64_t n,
                  int64_t nc, int64_t M, bool first, Buffers& buf) {
  float* o = buf.o.data();
  const int64_t Dp = pb.Dp;
#if RS_HAVE_EXTEND_BF16
  if constexpr (kBf16Dot<kv_t>) {
    pack_values_bf16(v, pb.kv_row_stride, slots, n, pb.D, Dp, buf.vb.data());
    for (int64_t r = 0; r < M; ++r) round_row_bf16(buf.s.data() + r * kKeys, nc, buf.pb.data() + r * (kKeys / 2));
    const int64_t kp = (n + 1) / 2;  // key pairs; an odd n's last pair meets a zero V row
    if (first) {
      tile_gemm_bf16<false>(buf.pb.data(), kKeys / 2, buf.vb.data(), Dp, kp, o, Dp, M, Dp, nullptr);
    } else {
      tile_gemm_bf16<true>(buf.pb.data(), kKeys / 2, buf.vb.data(), Dp, kp, o, Dp, M, Dp, buf.alpha.data());
    }
    return;
  }
#endif
  pack_values(v, pb.kv_row_stride, v_scale, pb.Hkv, slots, n, pb.D, Dp, buf.v.data());
  if (first) {
    tile_gemm<false>(buf.s.data(), kKeys, buf.v.data(), Dp, n, o, Dp, M, Dp, nullptr);
  } else {
    tile_gemm<true>(buf.s.data(), kKeys, buf.v.data(), Dp, n, o, Dp, M, Dp, buf.alpha.data());
  }
}

template <typename kv_t>
void run_item(const Problem<kv_t>& pb, const WorkItem& it, Buffers& buf) {
  const int64_t G = pb.G, D = pb.D, Dp = pb.Dp, M = it.nq * G;
  const int64_t prefix = pb.prefix[it.b];
  const int64_t first_pos = prefix + it.p0;  // absolute position of the item's first query
  const int64_t key_end = first_pos + it.nq;  // keys [0, key_end) are visible to some row
  const int32_t* slots = pb.rows[it.b];
  const uint8_t* tree = pb.tree.empty() ? nullptr : pb.tree[it.b];
  const int64_t ext = pb.ext[it.b];
  // Keys every row of the item sees: the prefix and, causally, new tokens before the item's first.
  const int64_t full_end = tree ? prefix : first_pos;
  const kv_t* k = pb.k + it.kh * D;
  const kv_t* v = pb.v + it.kh * D;
  const float* k_scale = pb.k_scale ? pb.k_scale + it.kh : nullptr;
  const float* v_scale = pb.v_scale ? pb.v_scale + it.kh : nullptr;
  buf.reserve(M, Dp, kBf16Dot<kv_t>);
  float *s = buf.s.data(), *o = buf.o.data();
  // Row r is query position p0 + r / G of head kh * G + r % G: position-major, so that rows of one
  // position share the causal limit.
  for (int64_t r = 0; r < M; ++r) {
    const float* src = pb.q + (pb.q_start[it.b] + it.p0 + r / G) * pb.qs0 + (it.kh * G + r % G) * pb.qs1;
#if RS_HAVE_EXTEND_BF16
    if constexpr (kBf16Dot<kv_t>) pack_query_row_bf16(src, D, Dp, pb.scale, buf.qb.data() + r * pairs(Dp));
    if constexpr (!kBf16Dot<kv_t>)
#endif
      pack_query_row(src, D, Dp, pb.scale, buf.q.data() + r * Dp);
    buf.m[r] = -std::numeric_limits<float>::infinity();
    buf.l[r] = 0.f;
  }
  // Key blocks: [0, full_end) in whole blocks (every row sees all of it), then the diagonal
  // [full_end, key_end), which starts a block of its own so that masking wastes at most the
  // block's own triangle (causal) or the new tokens (tree).
  for (int64_t kb = 0; kb < key_end;) {
    const int64_t n = std::min(kKeys, (kb < full_end ? full_end : key_end) - kb);
    const int64_t nc = (n + Vec::kWidth - 1) / Vec::kWidth * Vec::kWidth;
    const int64_t next = std::min(kKeys, key_end - kb - n);
    if (next > 0) {  // the slot indirection defeats the hardware prefetcher
      prefetch_rows(k, pb.kv_row_stride, slots + kb + n, next, D);
      prefetch_rows(v, pb.kv_row_stride, slots + kb + n, next, D);
    }
    scores_block(pb, k, k_scale, slots + kb, n, nc, M, buf);
    const bool diagonal = kb + n - 1 > first_pos;  // some key here lies past some row's position
    for (int64_t r = 0; r < M; ++r) {
      if (tree && kb >= full_end) {  // new tokens: the row's ancestors and itself
        const uint8_t* vis = tree + (it.p0 + r / G) * ext + (kb - prefix);
        buf.alpha[r] = softmax_row_masked(s + r * kKeys, vis, n, nc, buf.m[r], buf.l[r]);
        continue;
      }
      const int64_t visible = diagonal && !tree ? std::min(n, first_pos + r / G - kb + 1) : n;
      buf.alpha[r] = softmax_row<kBf16Dot<kv_t>>(s + r * kKeys, visible, n, nc, buf.m[r], buf.l[r]);
    }
    // The first block is visible to every row (key 0), so O starts as its P V.
    values_block(pb, v, v_scale, slots + kb, n, nc, M, kb == 0, buf);
    kb += n;
  }
  for (int64_t r = 0; r < M; ++r) {
    const int64_t tok = pb.q_start[it.b] + it.p0 + r / G, head = it.kh * G + r % G;
    float* dst = pb.out + (tok * pb.H + head) * D;
    const float inv = 1.f / buf.l[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = o[r * Dp + d] * inv;
  }
}

// Runs f(0..n-1) on the thread pool, each thread taking the next item when it finishes one (items
// differ in cost by up to the number of query blocks).
template <typename F>
void parallel_items(int64_t n, const F& f) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) f(t);
  });
}

template <typename kv_t>
void extend_attention_impl(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, at::Tensor& out,
                           const at::Tensor& req_to_token, const int64_t* pool_rows, const int64_t* seq_lens,
                           const int64_t* extend_lens, int64_t bs, double scale, const uint8_t* tree_mask,
                           const float* k_scale, const float* v_scale) {
  Problem<kv_t> pb;
  pb.q = q.data_ptr<float>();
  pb.qs0 = q.stride(0), pb.qs1 = q.stride(1);
  pb.k = k_buf.data_ptr<kv_t>(), pb.v = v_buf.data_ptr<kv_t>();
  pb.k_scale = k_scale, pb.v_scale = v_scale;
  pb.H = q.size(1), pb.Hkv = k_buf.size(1), pb.D = q.size(2);
  pb.G = pb.H / pb.Hkv;
  pb.Dp = (pb.D + Vec::kWidth - 1) / Vec::kWidth * Vec::kWidth;
  pb.kv_row_stride = pb.Hkv * pb.D;
  pb.out = out.data_ptr<float>();
  pb.scale = static_cast<float>(scale);
  const int32_t* r2t = req_to_token.data_ptr<int32_t>();
  const int64_t bq = std::max<int64_t>(1, kTargetRows / pb.G);  // query positions per item
  std::vector<WorkItem> items;
  int64_t q_start = 0;
  for (int64_t b = 0; b < bs; ++b) {
    pb.rows.push_back(r2t + pool_rows[b] * req_to_token.stride(0));
    pb.q_start.push_back(q_start);
    pb.prefix.push_back(seq_lens[b] - extend_lens[b]);
    pb.ext.push_back(extend_lens[b]);
    if (tree_mask) {
      pb.tree.push_back(tree_mask);
      tree_mask += extend_lens[b] * extend_lens[b];
    }
    for (int64_t p0 = 0; p0 < extend_lens[b]; p0 += bq) {
      const int64_t nq = std::min(bq, extend_lens[b] - p0);
      for (int64_t kh = 0; kh < pb.Hkv; ++kh) {
        items.push_back({b, kh, p0, nq, nq * pb.G * (pb.prefix[b] + p0 + nq)});
      }
    }
    q_start += extend_lens[b];
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  parallel_items(static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local Buffers buf;
    run_item(pb, items[i], buf);
  });
}
#endif

}  // namespace

void extend_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, at::Tensor& out,
                      const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                      const at::Tensor& extend_lens, double scale, const c10::optional<at::Tensor>& tree_mask,
                      const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3 && out.dim() == 2,
                    "extend_attention: q [T, H, D], k_buf/v_buf [N, Hkv, D], out [T, H * D]");
  TORCH_CHECK_VALUE(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
                    "extend_attention: q and out must be float32");
  TORCH_CHECK_VALUE(k_buf.scalar_type() == v_buf.scalar_type(), "extend_attention: K/V dtypes differ");
  const float *ks = nullptr, *vs = nullptr;
  std::tie(ks, vs) = kv_scales("extend_attention", k_buf, k_scale, v_scale);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_buf.size(1);
  TORCH_CHECK_VALUE(q.stride(2) == 1, "extend_attention: q's head_dim must be contiguous");
  TORCH_CHECK_VALUE(k_buf.is_contiguous() && v_buf.is_contiguous() && out.is_contiguous(),
                    "extend_attention: k_buf, v_buf and out must be contiguous");
  TORCH_CHECK_VALUE(k_buf.sizes() == v_buf.sizes() && k_buf.size(2) == D, "extend_attention: K/V shapes");
  TORCH_CHECK_VALUE(Hkv >= 1 && H % Hkv == 0, "extend_attention: num_heads % num_kv_heads != 0");
  TORCH_CHECK_VALUE(D % 8 == 0 && D >= 8 && D <= 512, "extend_attention: head_dim must be a multiple of 8 in [8, 512]");
  TORCH_CHECK_VALUE(out.size(0) == T && out.size(1) == H * D, "extend_attention: out must be [T, H * D]");
  TORCH_CHECK_VALUE(req_to_token.dim() == 2 && req_to_token.scalar_type() == at::kInt && req_to_token.stride(1) == 1,
                    "extend_attention: req_to_token must be int32 [rows, max_context] with contiguous rows");
  for (const at::Tensor* t : {&req_pool_indices, &seq_lens, &extend_lens}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->scalar_type() == at::kLong && t->is_contiguous(),
                      "extend_attention: req_pool_indices, seq_lens and extend_lens must be contiguous int64 [bs]");
  }
  const int64_t bs = seq_lens.size(0);
  TORCH_CHECK_VALUE(req_pool_indices.size(0) == bs && extend_lens.size(0) == bs, "extend_attention: batch sizes differ");
  const int64_t* rows = req_pool_indices.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* ext = extend_lens.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < bs; ++b) {  // host loops: a bad length would read outside the pool
    TORCH_CHECK_VALUE(rows[b] >= 0 && rows[b] < req_to_token.size(0), "extend_attention: req_pool_index ", rows[b],
                      " outside [0, ", req_to_token.size(0), ")");
    TORCH_CHECK_VALUE(ext[b] >= 0 && ext[b] <= lens[b] && lens[b] <= req_to_token.size(1),
                      "extend_attention: request ", b, " has extend_len ", ext[b], " and seq_len ", lens[b],
                      " (need 0 <= extend_len <= seq_len <= ", req_to_token.size(1), ")");
    const int32_t* row = req_to_token.data_ptr<int32_t>() + rows[b] * req_to_token.stride(0);
    for (int64_t j = 0; j < lens[b]; ++j) {
      TORCH_CHECK_VALUE(row[j] >= 0 && row[j] < k_buf.size(0), "extend_attention: request ", b, " key ", j,
                        " has slot ", row[j], " outside the pool of ", k_buf.size(0));
    }
    total += ext[b];
  }
  TORCH_CHECK_VALUE(total == T, "extend_attention: sum(extend_lens) = ", total, " but q has ", T, " tokens");
  const uint8_t* tree = nullptr;
  if (tree_mask.has_value()) {
    const at::Tensor& m = *tree_mask;
    TORCH_CHECK_VALUE(m.dim() == 1 && m.scalar_type() == at::kByte && m.is_contiguous(),
                      "extend_attention: tree_mask must be a contiguous uint8 [sum(extend_lens^2)] tensor");
    int64_t need = 0;
    for (int64_t b = 0; b < bs; ++b) need += ext[b] * ext[b];
    TORCH_CHECK_VALUE(m.numel() == need, "extend_attention: tree_mask has ", m.numel(), " entries, need ", need,
                      " (each request's [extend_len, extend_len] mask, concatenated)");
    tree = m.data_ptr<uint8_t>();
    // A row must see itself and nothing after it: the kernel visits keys up to the last row of
    // each block of queries, and a row with no visible key would divide by zero.
    const uint8_t* at = tree;
    for (int64_t b = 0; b < bs; ++b) {
      for (int64_t i = 0; i < ext[b]; ++i) {
        TORCH_CHECK_VALUE(at[i * ext[b] + i] != 0, "extend_attention: tree_mask of request ", b, " hides row ", i,
                          " from itself");
        for (int64_t j = i + 1; j < ext[b]; ++j) {
          TORCH_CHECK_VALUE(at[i * ext[b] + j] == 0, "extend_attention: tree_mask of request ", b, " lets row ", i,
                            " see the later row ", j, " (parents must come before their children)");
        }
      }
      at += ext[b] * ext[b];
    }
  }
#if RS_HAVE_AVX2
  dispatch_kv_dtype(k_buf.scalar_type(), "extend_attention", [&](auto tag) {
    using kv_t = decltype(tag);
    extend_attention_impl<kv_t>(q, k_buf, v_buf, out, req_to_token, rows, lens, ext, bs, scale, tree, ks, vs);
  });
#else
  TORCH_CHECK(false, "extend_attention: sgl_kernel._cpu was built without AVX2; use the torch-native path");
#endif
}
