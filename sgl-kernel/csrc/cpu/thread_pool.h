// The compiled decode step's own thread team (issue 40).
//
// Why: a decode step (DecodeModel::forward) runs a few hundred short parallel regions. On torch's
// OpenMP team with radixserve's ~10 us spin (utils/cpus.py: a longer spin gives a busy
// neighbour's core away, issue 46) the workers fall asleep between most regions, and each region
// then waits for a futex wake-up: ~10% of a one-row step on a 2-core Zen 3. The step's kernels
// run their loops here instead, on a team whose workers stay hot through the step by spinning
// with PAUSE, give the core away (sched_yield) every ~4 us of spinning so a neighbour sharing it
// runs, and sleep on a futex after ~100 us or as soon as the step ends.
//
// rs::parallel_for(begin, end, grain, f) splits the range exactly as at::parallel_for does (the
// same chunks, so the same bits); the team only changes which thread runs a chunk: every thread,
// the caller included, takes the next unstarted chunk, so a worker woken late or preempted leaves
// its chunk to one that runs. Outside a step (a kernel called from Python, or with
// RADIXSERVE_STEP_TEAM=0) it is at::parallel_for itself.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace rs {

namespace team {

// A chunk body, type-erased: (*fn)(ctx, begin, end).
using RangeFn = void (*)(const void* ctx, int64_t begin, int64_t end);

// This thread's relation to a team: kNone (no step, or the team is off), kMaster (it runs a step
// with a team and is between regions), kInRegion (inside a region, as the caller or a worker).
enum class Role : int { kNone = 0, kMaster = 1, kInRegion = 2 };
Role role();
// The team's size (the caller included) while role() is kMaster.
int64_t size();
// Runs chunks [begin + i * chunk, min(end, begin + (i + 1) * chunk)) for i in [0, tasks) on the
// team (the caller too) and returns when all are done; rethrows the first exception one threw.
void run(int64_t begin, int64_t end, int64_t chunk, int64_t tasks, RangeFn fn, const void* ctx);

}  // namespace team

// A step's scope: while one is alive on this thread (the outermost one wins), rs::parallel_for
// on it runs on the step team. Nothing when RADIXSERVE_STEP_TEAM=0, at one thread, or when another
// thread's step holds the team (that step keeps at::parallel_for).
class StepTeam {
 public:
  StepTeam();
  ~StepTeam();
  StepTeam(const StepTeam&) = delete;
  StepTeam& operator=(const StepTeam&) = delete;

 private:
  bool owner_ = false;
};

// A step's scope held across Python (issue 40): the served one-token step runs the fused stack,
// a Python gap, then the LM head (the panels' one-row product or the greedy candidate pass); held
// from before the stack to after the head, the team stays hot through the gap (the stack's own StepTeam then nests and owns
// nothing) instead of parking at the stack's end and waking for the head. enter returns whether
// this thread now holds a team (false: already held, team off, one thread, or another step has
// it); exit releases what enter took (nothing when it took nothing). One thread's calls only.
bool step_team_enter();
void step_team_exit();

// For tests and profiles: steps that held the team, regions run on it, chunks its workers ran
// (not the caller), and the team's size (0 before the first step).
std::vector<int64_t> step_team_stats();
// Runs rs::parallel_for(0, n, grain) inside a StepTeam, each chunk sleeping 200 us (so workers
// take some) and throwing where it holds throw_at; returns the chunks run, sorted.
std::vector<std::pair<int64_t, int64_t>> step_team_probe(int64_t n, int64_t grain, int64_t throw_at);

// at::get_num_threads(), or the team's size inside a step: the same number (the team follows
// torch's thread count), read where a kernel sizes its split.
inline int64_t get_num_threads() {
  return team::role() == team::Role::kMaster ? team::size() : at::get_num_threads();
}

// at::parallel_for's contract and split (ATen/Parallel-inl.h, ParallelOpenMP.h): inline when
// the range is at most one grain, within a region, or at one thread; else min(threads, ceil(n /
// grain)) chunks of ceil(n / that), the empty tail chunks dropped.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const team::Role r = team::role();
  if (r == team::Role::kNone) return at::parallel_for(begin, end, grain, f);
  if (begin >= end) return;
  const int64_t n = end - begin, threads = team::size();
  if (n <= grain || n <= 1 || r == team::Role::kInRegion || threads <= 1) {
    at::internal::ThreadIdGuard tid_guard(0);
    c10::ParallelGuard guard(true);
    f(begin, end);
    return;
  }
  const int64_t split = grain > 0 ? std::min(threads, (n + grain - 1) / grain) : threads;
  const int64_t chunk = (n + split - 1) / split;
  team::run(begin, end, chunk, (n + chunk - 1) / chunk,
            [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); }, &f);
}

// n items in runs of `run` that the team's threads pull, so a thread woken late or preempted leaves
// its runs to one that runs (at::parallel_for's fixed halves wait for it). Only for loops whose
// results do not depend on which items share a run. Outside a step: parallel_for's split.
template <class F>
void parallel_runs(int64_t n, int64_t run, const F& f) {
  if (team::role() != team::Role::kMaster || team::size() <= 1 || n <= run || run <= 0)
    return parallel_for(0, n, run, f);
  run = std::max(run, (n + 0xfffe) / 0xffff);  // the team's ticket counts at most 65535 tasks
  team::run(0, n, run, (n + run - 1) / run,
            [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); }, &f);
}

}  // namespace rs
