// One decode step's K/V rows requested into L2 ahead of the attention that reads them.
//
// Why: at a few rows a layer's attention reads its requests' whole context from the KV pool, and
// by then the step has streamed every other layer's weights through the caches: on Zen 4 (one
// thread, bf16 pool, 9 query / 3 KV heads of 64) decode_attention took 20-36 us a layer over cold
// rows against 9-17 us over rows in cache, at 128-256 tokens of context, most of a layer's time
// outside its linears. Requested before the qkv projection, the rows arrive while the projection
// streams its weights (the two reads overlap instead of following each other). Only hints: the
// results do not change.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

// The most bytes of K and V together requested a layer: a share of one core's L2 (1 MB on Zen 4,
// 256 KB-2 MB elsewhere) that leaves room for the projection's own weight stream; past it (long
// contexts) the attention's first rows are requested and the hardware prefetcher takes the rest.
constexpr int64_t kKvPrefetchBytes = 192 * 1024;

// L2 prefetches of every request's K and V rows req_to_token[req_pool_indices[b], :seq_lens[b] - 1]
// (the step's own row is written later by store_kv), up to kKvPrefetchBytes in all.
inline void prefetch_kv_rows(const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& req_to_token,
                             const at::Tensor& req_pool_indices, const at::Tensor& seq_lens) {
  if (req_to_token.scalar_type() != at::kInt || req_pool_indices.scalar_type() != at::kLong ||
      seq_lens.scalar_type() != at::kLong || !req_to_token.is_contiguous())
    return;  // decode_attention checks and reports these; a hint just steps aside
  const int64_t row_bytes = k_buf.stride(0) * k_buf.element_size(), width = req_to_token.size(1);
  const auto* k = static_cast<const char*>(k_buf.data_ptr());
  const auto* v = static_cast<const char*>(v_buf.data_ptr());
  const int32_t* table = req_to_token.data_ptr<int32_t>();
  const int64_t* rows = req_pool_indices.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  int64_t budget = kKvPrefetchBytes;
  for (int64_t b = 0; b < seq_lens.numel() && budget > 0; ++b) {
    const int32_t* slots = table + rows[b] * width;
    const int64_t n = std::min<int64_t>(lens[b] - 1, width);
    for (int64_t t = 0; t < n && budget > 0; ++t, budget -= 2 * row_bytes) {
      const int64_t at = static_cast<int64_t>(slots[t]) * row_bytes;
      for (int64_t off = 0; off < row_bytes; off += 64) {
        __builtin_prefetch(k + at + off, 0, 2);  // locality 2: prefetcht1, into L2
        __builtin_prefetch(v + at + off, 0, 2);
      }
    }
  }
}

// Up to this many rows a step (the one-row loop's domain): a batch's attention has enough
// independent tasks for the hardware's own prefetch, and its context outgrows the budget anyway.
constexpr int64_t kKvPrefetchMaxRows = 8;

// RADIXSERVE_DISABLE_KV_PREFETCH=1 turns the hints off (A/B benchmarks), read once.
inline bool kv_prefetch_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("RADIXSERVE_DISABLE_KV_PREFETCH");
    return v == nullptr || v[0] == '\0' || (v[0] == '0' && v[1] == '\0');
  }();
  return on;
}
