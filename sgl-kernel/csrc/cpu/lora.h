// The LoRA delta in two steps, for callers that apply one batch's rows to many projections (the
// fused decode stack: 7 projections x every layer of one step share the rows' slots): plan once
// per step, apply per projection. lora_delta_ (ops.h) is the two in one call.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

// A batch's adapted rows sorted by slot and cut into work items of one slot each.
struct LoraPlan {
  struct Item {
    int64_t slot, start, end;  // rows order[start:end], all of `slot`
  };
  int64_t num_rows = 0, num_slots = 0;  // what the plan was made for
  std::vector<int64_t> order;            // adapted row indices, slot by slot
  std::vector<Item> items;               // empty: no row is adapted
};

// token_slots int64 [n], each in [-1, num_slots) (-1: a row of the base model).
LoraPlan lora_plan(const at::Tensor& token_slots, int64_t num_slots);

// out[t] += (x[t] @ a[s]^T) @ b[s] for the plan's rows, with lora_delta_'s layouts and dtypes;
// a must have the plan's num_slots and x its num_rows.
void lora_apply_(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const LoraPlan& p, at::Tensor& out);

// The largest rank lora_apply_ takes (its rank-r intermediate lives on the stack).
int64_t lora_max_rank();
