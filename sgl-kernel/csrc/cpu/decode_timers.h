// Where DecodeModel::forward's time goes, part by part (issue 40: a one-row step spent ~31 us a
// layer outside its linears and ~20 us of it was not accounted for). Off unless the environment
// sets RADIXSERVE_DECODE_TIMERS before the first forward: "1" adds the wall time of each part
// (laps on the calling thread, so a part includes its parallel region's fork and join), "cpu" the
// calling thread's CPU time (one thread on a shared machine: the work without the descheduling),
// to process-wide totals that decode_model_timers() reads and resets.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

namespace decode_timers {

// The parts, in a layer's order; kOther is everything before the first layer and after the last.
enum Part : int { kNorm, kQkv, kRopeKv, kAttention, kO, kGateUp, kAct, kDown, kOther, kParts };

enum Clock : int { kOff, kWall, kThreadCpu };

inline Clock clock_kind() {
  static const Clock kind = [] {
    const char* v = std::getenv("RADIXSERVE_DECODE_TIMERS");
    if (v == nullptr) return kOff;
    return std::strcmp(v, "1") == 0 ? kWall : std::strcmp(v, "cpu") == 0 ? kThreadCpu : kOff;
  }();
  return kind;
}

inline int64_t now_ns(Clock kind) {
  timespec ts;
  clock_gettime(kind == kThreadCpu ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// Nanoseconds per part, and [kParts] the forwards counted.
inline std::array<std::atomic<int64_t>, kParts + 1>& totals() {
  static std::array<std::atomic<int64_t>, kParts + 1> t{};
  return t;
}

// A forward's laps: lap(part) charges the time since the previous lap to `part`. Inert (one
// branch a lap) when the timers are off.
class Laps {
 public:
  Laps() : kind_(clock_kind()), last_(kind_ == kOff ? 0 : now_ns(kind_)) {}
  void lap(Part part) {
    if (kind_ == kOff) return;
    const int64_t now = now_ns(kind_);
    totals()[part] += now - last_;
    last_ = now;
  }
  ~Laps() {
    if (kind_ != kOff) totals()[kParts] += 1;
  }

 private:
  Clock kind_;
  int64_t last_;
};

// The totals (ns per part, then the forward count), reset to zero when `reset`.
inline std::vector<int64_t> read(bool reset) {
  std::vector<int64_t> out;
  for (auto& t : totals()) out.push_back(reset ? t.exchange(0) : t.load());
  return out;
}

}  // namespace decode_timers
