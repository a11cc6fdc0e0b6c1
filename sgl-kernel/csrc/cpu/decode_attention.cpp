// Paged decode attention on CPU, reading K/V in place from the token pool.
//
// Why: the torch-native reference gathers every request's K/V into a padded tensor per layer
// (a copy of the whole context, every layer, every step) and then runs SDPA with a mask. Here
// K/V rows are read where they are, through each request's req_to_token row.
//
// The main path (AVX2 or AVX-512, head_dim a multiple of the vector width, up to 8 query heads per
// KV head) is flash-decoding: tokens are folded block by block into an online-softmax state
// (attention_block.h), and the work is planned as segments of slot rows:
// - Cascade over shared prefixes. Requests whose rows start with the same slots share those
//   tokens' K/V (the radix cache hands them the same slots), so the shared run is one segment
//   folded for all of them: its K/V is read from memory once per step instead of once per request.
// - Splits. When there are too few (segment, KV head) tasks for the threads (one long request),
//   segments are split; partial states are merged by their log-sum-exp at the end.
// Other shapes (and builds without AVX2) take a two-pass path: scores, softmax, values.
// bf16 pools on AVX512_BF16 builds fold by bf16 dot products (attention_block_bf16.h: q * scale and
// the softmax weights rounded to bf16); other pools, the fp32 block step.
// There a request of up to kShortMaxTokens tokens folded alone (no shared prefix, no split)
// takes the whole-request path instead (attention_short_bf16.h: all scores, one softmax, then the
// values), and prefetches the K/V rows of the task its thread runs next.
#include "attention_block.h"
#include "attention_block_bf16.h"
#include "attention_short_bf16.h"
#include "common.h"
#include "ops.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <type_traits>

namespace {

constexpr int64_t kTokensPerStep = 4;
// How many tokens ahead the two-pass path requests K rows (score pass) and V rows (value pass)
// into L1. Hints only. Why: at long contexts the rows come from memory (a step streams every
// layer's weights and K/V through the caches), and the passes waited on each row in turn:
// one request of 2048 tokens, 9 / 3 heads of 64, bf16, 30 layers' pools in turn, two threads,
// Zen 3: 445-456 -> 259-278 us a layer (median; warm rows ~200 either way).
constexpr int64_t kScoreAhead = 32, kValueAhead = 16;

#if RS_HAVE_AVX2
// L1 prefetches of the cache lines of [row, row + bytes).
template <typename kv_t>
inline void prefetch_row(const kv_t* row, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + at, _MM_HINT_T0);
}
#endif

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
  const float* k_scale;  // int8 pools: per-(slot, KV head) scales offset to this head; else nullptr
  const float* v_scale;
  int64_t scale_stride;  // Hkv
};

// scores[g * len + t] = scale * q_g . K[slots[t]]
template <typename kv_t>
void score_pass(const TaskArgs<kv_t>& a, float* scores) {
  int64_t t = 0;
#if RS_HAVE_AVX2
  if (a.D % 8 == 0) {
    for (; t + kTokensPerStep <= a.len; t += kTokensPerStep) {
      for (int64_t j = t + kScoreAhead; j < std::min(a.len, t + kScoreAhead + kTokensPerStep); ++j)
        prefetch_row(a.k_buf + static_cast<int64_t>(a.slots[j]) * a.kv_row_stride, a.D * sizeof(kv_t));
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
        for (int j = 0; j < kTokensPerStep; ++j) {
          scores[g * a.len + t + j] = hsum(acc[j]) * a.scale * row_scale(a.k_scale, a.slots[t + j], a.scale_stride);
        }
      }
    }
  }
#endif
  for (; t < a.len; ++t) {
    const kv_t* k = a.k_buf + static_cast<int64_t>(a.slots[t]) * a.kv_row_stride;
    const float ks = a.scale * row_scale(a.k_scale, a.slots[t], a.scale_stride);
    for (int64_t g = 0; g < a.G; ++g) scores[g * a.len + t] = dot(a.q + g * a.q_head_stride, k, a.D) * ks;
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
          if (t + kValueAhead < a.len)
            prefetch_row(a.v_buf + static_cast<int64_t>(a.slots[t + kValueAhead]) * a.kv_row_stride + d0, 1);  // one line
          const kv_t* v = a.v_buf + static_cast<int64_t>(a.slots[t]) * a.kv_row_stride + d0;
          const __m256 w = _mm256_set1_ps(pg[t] * row_scale(a.v_scale, a.slots[t], a.scale_stride));
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
    const float vs = row_scale(a.v_scale, a.slots[t], a.scale_stride);
    for (int64_t g = 0; g < a.G; ++g) axpy(acc.data() + g * a.D, p[g * a.len + t] * vs, v, a.D);
  }
  for (int64_t g = 0; g < a.G; ++g) {
    std::memcpy(a.out + g * a.out_head_stride, acc.data() + g * a.D, sizeof(float) * a.D);
  }
}

#if RS_HAVE_AVX2
constexpr int64_t kMinSplitTokens = 128;  // no split shorter than this
constexpr int64_t kMinSharedTokens = 64;  // a shared prefix shorter than this is not worth a segment

template <int G, typename kv_t>
void fold_range_g(const HeadView<kv_t>* views, const HeadState* states, int64_t n, int64_t nh, int64_t D,
                  const int32_t* slots, int64_t t0, int64_t t1) {
  const int64_t chunks = D / Vec::kWidth;
#if RS_HAVE_DECODE_BF16
  if constexpr (std::is_same_v<kv_t, at::BFloat16>) {  // vdpbf16ps (attention_block_bf16.h)
    if (decode_bf16_applies(D)) {
      if constexpr (bf16_value_chunks<G>() == 4) {
        if (chunks % 4 == 0) return fold_range_bf16<G, 4>(views, states, n, nh, D, slots, t0, t1);
      }
      return fold_range_bf16<G, 2>(views, states, n, nh, D, slots, t0, t1);
    }
  }
#endif
  constexpr int kMax = max_value_chunks<G>();
  if (kMax >= 4 && chunks % 4 == 0) return fold_range<G, 4>(views, states, n, nh, D, slots, t0, t1);
  if (kMax >= 2 && chunks % 2 == 0) return fold_range<G, 2>(views, states, n, nh, D, slots, t0, t1);
  fold_range<G, 1>(views, states, n, nh, D, slots, t0, t1);
}

template <typename kv_t>
bool fold_range_dispatch(const HeadView<kv_t>* views, const HeadState* states, int64_t n, int64_t nh, int64_t G,
                         int64_t D, const int32_t* slots, int64_t t0, int64_t t1) {
  if (D % Vec::kWidth != 0) return false;
  switch (G) {
    case 1: fold_range_g<1>(views, states, n, nh, D, slots, t0, t1); return true;
    case 2: fold_range_g<2>(views, states, n, nh, D, slots, t0, t1); return true;
    case 3: fold_range_g<3>(views, states, n, nh, D, slots, t0, t1); return true;
    case 4: fold_range_g<4>(views, states, n, nh, D, slots, t0, t1); return true;
    case 5: fold_range_g<5>(views, states, n, nh, D, slots, t0, t1); return true;
    case 6: fold_range_g<6>(views, states, n, nh, D, slots, t0, t1); return true;
    case 7: fold_range_g<7>(views, states, n, nh, D, slots, t0, t1); return true;
    case 8: fold_range_g<8>(views, states, n, nh, D, slots, t0, t1); return true;
    default: return false;
  }
}

bool online_path_applies(int64_t G, int64_t D) {
  return D % Vec::kWidth == 0 && D <= kMaxHeadDim && G >= 1 && G <= 8;
}

// Tokens [t0, t1) of request `rep`'s slot row, folded for each request in members[mb, me).
struct Segment {
  int64_t rep, t0, t1, mb, me, part_base;  // member i's state is part part_base + (i - mb)
};

struct Plan {
  bool has_shared = false;  // some segment is a prefix shared by several requests
  std::vector<Segment> segments;
  std::vector<int64_t> members;
  std::vector<std::vector<int64_t>> parts_of;  // per request, the parts merged into its output
  int64_t num_parts = 0;
  bool any_merge = false;  // some request has more than one part
};

// Runs f(0..n-1) on the thread pool, each thread taking the next task when it finishes one:
// segments differ in work (a shared prefix folded for 8 requests vs one request's tail), and
// at::parallel_for's static halves left one thread idle for a third of the time.
// f(task, next): `next` is the task this thread takes after `task` (claimed before `task` runs,
// so that its K/V rows can be prefetched meanwhile), or -1.
template <typename F>
void parallel_tasks(int64_t n, const F& f) {
  std::atomic<int64_t> next{0};
  rs::parallel_for(0, std::min<int64_t>(rs::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1); t < n;) {
      const int64_t after = next.fetch_add(1);
      f(t, after < n ? after : -1);
      t = after;
    }
  });
}

int64_t common_prefix(const int32_t* a, const int32_t* b, int64_t n) {
  int64_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

// Shared-prefix groups (same first slot, common run >= kMinSharedTokens), then every request's
// own remainder; ranges are split where one would hold more than its share of the work.
Plan make_plan(int64_t bs, int64_t Hkv, const std::vector<const int32_t*>& rows, const int64_t* lens) {
  struct Range {
    int64_t rep, t0, t1;
    std::vector<int64_t> members;
  };
  std::vector<Range> ranges;
  std::vector<int64_t> own_start(bs, 0);
  std::map<int32_t, std::vector<int64_t>> by_first_slot;
  for (int64_t b = 0; b < bs; ++b) by_first_slot[rows[b][0]].push_back(b);
  for (auto& [slot, group] : by_first_slot) {
    if (group.size() < 2) continue;
    const int64_t rep = group[0];
    int64_t shared = lens[rep] - 1;  // every request keeps at least its newest token as its own
    for (int64_t m : group) shared = std::min(shared, lens[m] - 1);
    for (size_t i = 1; i < group.size(); ++i) shared = common_prefix(rows[rep], rows[group[i]], shared);
    if (shared < kMinSharedTokens) continue;
    ranges.push_back({rep, 0, shared, group});
    for (int64_t m : group) own_start[m] = shared;
  }
  for (int64_t b = 0; b < bs; ++b) ranges.push_back({b, own_start[b], lens[b], {b}});
  // Split the ranges whose work (tokens x requests folded) exceeds an even share of
  // 4 tasks per thread, so that no thread is left with one long shared prefix.
  int64_t total_work = 0;
  for (const Range& r : ranges) total_work += (r.t1 - r.t0) * static_cast<int64_t>(r.members.size()) * Hkv;
  const int64_t share = std::max<int64_t>(1, total_work / (4 * rs::get_num_threads()));

  Plan plan;
  plan.has_shared = ranges.size() > static_cast<size_t>(bs);
  plan.parts_of.resize(bs);
  for (const Range& r : ranges) {
    const int64_t len = r.t1 - r.t0, work = len * static_cast<int64_t>(r.members.size()) * Hkv;
    const int64_t pieces = std::max<int64_t>(1, std::min((work + share - 1) / share, len / kMinSplitTokens));
    for (int64_t s = 0; s < pieces; ++s) {
      const int64_t mb = static_cast<int64_t>(plan.members.size());
      plan.members.insert(plan.members.end(), r.members.begin(), r.members.end());
      const int64_t me = static_cast<int64_t>(plan.members.size());
      plan.segments.push_back({r.rep, r.t0 + len * s / pieces, r.t0 + len * (s + 1) / pieces, mb, me, plan.num_parts});
      for (int64_t m : r.members) plan.parts_of[m].push_back(plan.num_parts++);
    }
  }
  for (const auto& parts : plan.parts_of) plan.any_merge |= parts.size() > 1;
  return plan;
}

// out[g] = sum_p exp(m_p[g] - M) acc_p[g] / sum_p exp(m_p[g] - M) l_p[g], M = max_p m_p[g], over
// the parts `parts` of one (request, KV head); part p's state starts at part_at(p).
template <typename PartAt>
void merge_parts(const std::vector<int64_t>& parts, PartAt part_at, int64_t G, int64_t D, float* out,
                 int64_t out_head_stride) {
  for (int64_t g = 0; g < G; ++g) {
    float M = -std::numeric_limits<float>::infinity();
    for (int64_t p : parts) M = std::max(M, part_at(p)[G * D + g]);
    float denom = 0.f;
    float* o = out + g * out_head_stride;
    std::fill(o, o + D, 0.f);
    for (int64_t p : parts) {
      const float* st = part_at(p);
      if (st[G * D + G + g] == 0.f) continue;  // an empty part
      const float w = std::exp(st[G * D + g] - M);
      denom += w * st[G * D + G + g];
      axpy(o, w, st + g * D, D);
    }
    const float inv = 1.f / denom;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}
#endif

// The two-pass path for one (request, KV head).
template <typename kv_t>
void two_pass_task(const TaskArgs<kv_t>& a, std::vector<float>& scores, std::vector<float>& acc) {
  scores.resize(static_cast<size_t>(a.G * a.len));
  score_pass(a, scores.data());
  for (int64_t g = 0; g < a.G; ++g) softmax_inplace(scores.data() + g * a.len, a.len);
  value_pass(a, scores.data(), acc);
}

template <typename kv_t>
void decode_attention_impl(
    const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, at::Tensor& out,
    const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
    double scale, const float* k_scale, const float* v_scale) {
  const int64_t bs = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_buf.size(1);
  const int64_t G = H / Hkv;
  const float* q_ptr = q.data_ptr<float>();
  const kv_t* k_ptr = k_buf.data_ptr<kv_t>();
  const kv_t* v_ptr = v_buf.data_ptr<kv_t>();
  float* out_ptr = out.data_ptr<float>();
  const int32_t* r2t = req_to_token.data_ptr<int32_t>();
  const int64_t* pool_rows = req_pool_indices.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t r2t_stride = req_to_token.stride(0);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  std::vector<const int32_t*> rows(bs);
  for (int64_t b = 0; b < bs; ++b) rows[b] = r2t + pool_rows[b] * r2t_stride;
#if RS_HAVE_AVX2
  // With 16 AVX2 registers the two-pass path is faster than the online one (measured), except
  // where a shared prefix lets the online path read K/V once for many requests.
  const Plan plan = online_path_applies(G, D) ? make_plan(bs, Hkv, rows, lens) : Plan{};
  if (online_path_applies(G, D) && (RS_HAVE_AVX512 || plan.has_shared)) {
    const int64_t state_size = G * D + 2 * G;
    // Uninitialized: every state is reset by the task that folds it.
    const std::unique_ptr<float[]> parts(new float[static_cast<size_t>(plan.num_parts * Hkv * state_size)]);
    auto part_at = [&](int64_t part, int64_t kh) { return parts.get() + (part * Hkv + kh) * state_size; };
    // A request folded in one part (no shared prefix, no split: a batch of short contexts)
    // accumulates straight into its output rows and is normalized by its task; the others keep
    // part states, merged in a second pass (a second fork-join, skipped when none needs it).
    const bool direct_ok = os1 == D;
    auto direct = [&](int64_t b) { return direct_ok && plan.parts_of[b].size() == 1; };
    // A task folds one segment for every KV head (whole K/V rows: see fold_range), unless there
    // are too few segments to keep the threads busy; then one KV head each.
    const int64_t num_segments = static_cast<int64_t>(plan.segments.size());
    const int64_t nh = num_segments >= 2 * rs::get_num_threads() ? Hkv : 1;  // KV heads per task
    const int64_t head_groups = Hkv / nh;
    // A request of up to kShortMaxTokens folded alone into its output rows takes the
    // whole-request path on a bf16 pool (attention_short_bf16.h).
    const bool short_on = short_path_applies<kv_t>(D);
    // It writes the output rows at any stride, so its requests skip the merge pass either way.
    auto short_request = [&](int64_t b) {
      return short_on && plan.parts_of[b].size() == 1 && lens[b] <= kShortTokens;
    };
    auto is_short = [&](const Segment& seg) { return seg.me - seg.mb == 1 && short_request(plan.members[seg.mb]); };
    auto fold_short = [&]([[maybe_unused]] const Segment& seg, [[maybe_unused]] int64_t h0,
                          [[maybe_unused]] int64_t next_task) {
#if RS_HAVE_DECODE_BF16
      if constexpr (std::is_same_v<kv_t, at::BFloat16>) {
        thread_local std::vector<HeadView<kv_t>> hviews;
        thread_local std::vector<float*> outs;
        const int64_t b = plan.members[seg.mb];
        hviews.clear();
        outs.clear();
        for (int64_t kh = h0; kh < h0 + nh; ++kh) {
          hviews.push_back({q_ptr + b * qs0 + kh * G * qs1, qs1, k_ptr + kh * D, v_ptr + kh * D, Hkv * D,
                            static_cast<float>(scale)});
          outs.push_back(out_ptr + b * os0 + kh * G * os1);
        }
        // The rows of the task this thread takes next, requested into L2 while this one computes.
        NextRowsPrefetch next;
        if (next_task >= 0 && is_short(plan.segments[next_task / head_groups])) {
          const Segment& ns = plan.segments[next_task / head_groups];
          const int64_t nh0 = (next_task % head_groups) * nh, elem = sizeof(kv_t);
          thread_local std::vector<int64_t> lines;
          next.set(reinterpret_cast<const char*>(k_ptr + nh0 * D), reinterpret_cast<const char*>(v_ptr + nh0 * D),
                   Hkv * D * elem, nh * D * elem, rows[ns.rep] + ns.t0, ns.t1 - ns.t0, lines);
        }
        fold_request_dispatch(hviews.data(), nh, G, D, rows[seg.rep] + seg.t0, seg.t1 - seg.t0, outs.data(), os1,
                              next);
      }
#endif
    };
    // Segments come heaviest first (shared prefixes, then own tails), which dynamic scheduling
    // needs to balance well.
    parallel_tasks(num_segments * head_groups, [&](int64_t task, int64_t next_task) {
      thread_local std::vector<HeadView<kv_t>> views;  // [member][head]
      thread_local std::vector<HeadState> states;
      const Segment& seg = plan.segments[task / head_groups];
      const int64_t h0 = (task % head_groups) * nh;
      if (is_short(seg)) {
        fold_short(seg, h0, next_task);
        return;
      }
      views.clear();
      states.clear();
      for (int64_t i = seg.mb; i < seg.me; ++i) {
        const int64_t b = plan.members[i];
        for (int64_t kh = h0; kh < h0 + nh; ++kh) {
          views.push_back({q_ptr + b * qs0 + kh * G * qs1, qs1, k_ptr + kh * D, v_ptr + kh * D, Hkv * D,
                           static_cast<float>(scale), k_scale ? k_scale + kh : nullptr,
                           v_scale ? v_scale + kh : nullptr, Hkv});
          float* st = part_at(seg.part_base + (i - seg.mb), kh);
          float* acc = direct(b) ? out_ptr + b * os0 + kh * G * os1 : st;
          states.push_back({acc, st + G * D, st + G * D + G});
          reset_state(states.back(), G, D);
        }
      }
      fold_range_dispatch(views.data(), states.data(), seg.me - seg.mb, nh, G, D, rows[seg.rep], seg.t0, seg.t1);
      for (int64_t i = seg.mb; i < seg.me; ++i) {
        if (!direct(plan.members[i])) continue;
        for (int64_t j = (i - seg.mb) * nh; j < (i - seg.mb + 1) * nh; ++j) normalize_state(states[j], G, D);
      }
    });
    if (!plan.any_merge && direct_ok) return;
    rs::parallel_for(0, bs * Hkv, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / Hkv, kh = task % Hkv;
        if (direct(b) || short_request(b)) continue;
        merge_parts(plan.parts_of[b], [&](int64_t p) { return part_at(p, kh); }, G, D,
                    out_ptr + b * os0 + kh * G * os1, os1);
      }
    });
    return;
  }
#endif
  rs::parallel_for(0, bs * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, kh = task % Hkv;
      const TaskArgs<kv_t> a{q_ptr + b * qs0 + kh * G * qs1, qs1, k_ptr + kh * D, v_ptr + kh * D, k_buf.stride(0),
                             rows[b], lens[b], G, D, static_cast<float>(scale), out_ptr + b * os0 + kh * G * os1, os1,
                             k_scale ? k_scale + kh : nullptr, v_scale ? v_scale + kh : nullptr, Hkv};
      two_pass_task(a, scores, acc);
    }
  });
}

}  // namespace

void decode_attention(
    const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, at::Tensor& out,
    const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
    double scale, const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
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
  for (int64_t b = 0; b < seq_lens.numel(); ++b) {  // a host loop: cheaper than an ATen reduction
    const int64_t len = seq_lens.data_ptr<int64_t>()[b];
    TORCH_CHECK(len >= 1 && len <= req_to_token.size(1), "decode_attention: seq_len ", len, " outside [1, ",
                req_to_token.size(1), "]");
  }
  const float *ks = nullptr, *vs = nullptr;
  std::tie(ks, vs) = kv_scales("decode_attention", k_buf, k_scale, v_scale);
  dispatch_kv_dtype(k_buf.scalar_type(), "decode_attention", [&](auto tag) {
    using kv_t = decltype(tag);
    decode_attention_impl<kv_t>(q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, scale, ks, vs);
  });
}
