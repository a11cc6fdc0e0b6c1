// The step team of thread_pool.h: one process-wide team, lent to one step at a time.
#include "thread_pool.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace rs {
namespace {

void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A 32-bit atomic is its own futex word (same size and layout on Linux).
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word, int count) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, count, nullptr, nullptr, 0);
}

double env_us(const char* name, double fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const double us = std::strtod(v, &end);
  return end != v && us >= 0.0 ? us : fallback;
}

bool team_enabled() {
  const char* v = std::getenv("RADIXSERVE_STEP_TEAM");
  if (v == nullptr) return true;
  const std::string s(v);
  return !(s == "0" || s == "false" || s == "off" || s == "no");
}

// How a waiting thread spends its wait: PAUSE, sched_yield every yield_ns of it (a neighbour
// sharing the core runs; with none it returns at once), and asleep past sleep_ns.
class Spinner {
 public:
  Spinner(int64_t yield_ns, int64_t sleep_ns)
      : yield_ns_(yield_ns), sleep_ns_(sleep_ns), start_(now_ns()), last_yield_(start_) {}

  // False once the wait should go to sleep. The clock is read every 16 PAUSEs (~0.5 us on Zen 3).
  bool keep_spinning() {
    if (sleep_ns_ <= 0) return false;
    cpu_relax();
    if (++spins_ & 15) return true;
    const int64_t t = now_ns();
    if (t - start_ >= sleep_ns_) return false;
    if (t - last_yield_ >= yield_ns_) {
      sched_yield();
      last_yield_ = now_ns();
    }
    return true;
  }

 private:
  int64_t yield_ns_, sleep_ns_, start_, last_yield_;
  uint32_t spins_ = 0;
};

thread_local team::Role tls_role = team::Role::kNone;

// Counters for tests and profiles (step_team_stats).
std::atomic<int64_t> g_steps{0}, g_regions{0}, g_worker_chunks{0};

class Team {
 public:
  explicit Team(int64_t size) : size_(size) {
    for (int64_t i = 1; i < size; ++i) workers_.emplace_back([this, i] { worker_main(i); });
  }

  ~Team() {
    stop_.store(true, std::memory_order_release);
    publish(gen_.load(std::memory_order_relaxed) + 1);
    for (std::thread& t : workers_) t.join();
  }

  int64_t size() const { return size_; }

  void set_policy(int64_t yield_ns, int64_t sleep_ns) {
    yield_ns_.store(yield_ns, std::memory_order_relaxed);
    sleep_ns_.store(sleep_ns, std::memory_order_relaxed);
  }

  // A step starts: sleeping workers wake (an empty generation) and spin by its first region.
  void wake() {
    parked_.store(false, std::memory_order_relaxed);
    publish(gen_.load(std::memory_order_relaxed) + 1);
  }

  // A step ended: the next region is a Python-side gap away, so the workers sleep at once.
  void park() { parked_.store(true, std::memory_order_relaxed); }

  void run(int64_t begin, int64_t end, int64_t chunk, int64_t tasks, team::RangeFn fn, const void* ctx) {
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    tasks_ = tasks;
    fn_ = fn;
    ctx_ = ctx;
    error_ = nullptr;
    error_flag_.clear();
    done_.store(0, std::memory_order_relaxed);
    const uint32_t g = gen_.load(std::memory_order_relaxed) + 1;
    ticket_.store(pack(g, tasks, 0), std::memory_order_release);  // the job fields before it
    publish(g);
    tls_role = team::Role::kInRegion;
    drain(g, 0);
    wait_done(static_cast<uint32_t>(tasks));
    tls_role = team::Role::kMaster;
    g_regions.fetch_add(1, std::memory_order_relaxed);
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  // ticket_: generation (32 bits) | tasks (16) | next unclaimed chunk (16). One word, so a thread
  // that saw an old generation can never claim a chunk of a newer region.
  static uint64_t pack(uint32_t g, int64_t tasks, int64_t next) {
    return (uint64_t{g} << 32) | (static_cast<uint64_t>(tasks) << 16) | static_cast<uint64_t>(next);
  }

  void publish(uint32_t g) {
    gen_.store(g, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake(&gen_, INT_MAX);
  }

  // Claims and runs the chunks of region g until none is left; the job fields are read only
  // after a claim succeeds (the region cannot end, nor the fields change, before that chunk ends).
  void drain(uint32_t g, int64_t index) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      if (static_cast<uint32_t>(t >> 32) != g || (t & 0xffff) >= ((t >> 16) & 0xffff)) return;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      run_chunk(static_cast<int64_t>(t & 0xffff), index);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void run_chunk(int64_t i, int64_t index) {
    const int64_t b = begin_ + i * chunk_, e = std::min(end_, b + chunk_);
    const uint32_t tasks = static_cast<uint32_t>(tasks_);
    try {
      at::internal::ThreadIdGuard tid_guard(static_cast<int>(index));
      c10::ParallelGuard guard(true);
      fn_(ctx_, b, e);
    } catch (...) {
      if (!error_flag_.test_and_set()) error_ = std::current_exception();
    }
    if (index > 0) g_worker_chunks.fetch_add(1, std::memory_order_relaxed);
    if (done_.fetch_add(1, std::memory_order_seq_cst) + 1 == tasks &&
        master_sleeping_.load(std::memory_order_seq_cst) != 0)
      futex_wake(&done_, 1);
  }

  void wait_done(uint32_t tasks) {
    Spinner spin(yield_ns_.load(std::memory_order_relaxed), sleep_ns_.load(std::memory_order_relaxed));
    while (done_.load(std::memory_order_acquire) != tasks)
      if (!spin.keep_spinning()) break;
    master_sleeping_.store(1, std::memory_order_seq_cst);
    for (uint32_t d; (d = done_.load(std::memory_order_seq_cst)) != tasks;) futex_wait(&done_, d);
    master_sleeping_.store(0, std::memory_order_relaxed);
  }

  uint32_t wait_gen(uint32_t seen) {
    Spinner spin(yield_ns_.load(std::memory_order_relaxed), sleep_ns_.load(std::memory_order_relaxed));
    for (;;) {
      const uint32_t g = gen_.load(std::memory_order_acquire);
      if (g != seen) return g;
      if (parked_.load(std::memory_order_relaxed) || !spin.keep_spinning()) break;
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    uint32_t g;
    while ((g = gen_.load(std::memory_order_seq_cst)) == seen) futex_wait(&gen_, seen);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return g;
  }

  void worker_main(int64_t index) {
    tls_role = team::Role::kInRegion;  // a loop nested in a chunk runs inline, as in an OpenMP region
    for (uint32_t seen = 0;;) {
      seen = wait_gen(seen);
      if (stop_.load(std::memory_order_acquire)) return;
      drain(seen, index);
    }
  }

  const int64_t size_;
  std::vector<std::thread> workers_;
  // The current region's job, written by the caller before its ticket is published.
  int64_t begin_ = 0, end_ = 0, chunk_ = 0, tasks_ = 0;
  team::RangeFn fn_ = nullptr;
  const void* ctx_ = nullptr;
  std::exception_ptr error_;
  std::atomic_flag error_flag_ = ATOMIC_FLAG_INIT;
  alignas(64) std::atomic<uint32_t> gen_{0};  // futex word of waiting workers
  alignas(64) std::atomic<uint64_t> ticket_{0};
  alignas(64) std::atomic<uint32_t> done_{0};  // chunks finished; futex word of the waiting caller
  alignas(64) std::atomic<int32_t> sleepers_{0};
  std::atomic<uint32_t> master_sleeping_{0};
  std::atomic<bool> parked_{false}, stop_{false};
  std::atomic<int64_t> yield_ns_{4000}, sleep_ns_{100000};
};

// The process's team and the lock a step holds it by. Pointers, replaced in a forked child: the
// child has none of the parent's threads, and a lock a parent's step held stays locked there.
Team* g_team = nullptr;
std::mutex* g_mutex = new std::mutex;
thread_local Team* tls_team = nullptr;
// step_team_enter's scope on this thread (nullptr: none held by it).
thread_local StepTeam* tls_held = nullptr;

void after_fork_in_child() {
  g_team = nullptr;  // its threads did not follow: leaked, never joined
  g_mutex = new std::mutex;
  tls_role = team::Role::kNone;
  tls_team = nullptr;
  tls_held = nullptr;  // its team is the parent's: leaked, never released
}

const bool g_atfork = [] { return pthread_atfork(nullptr, nullptr, after_fork_in_child) == 0; }();

}  // namespace

namespace team {

Role role() { return tls_role; }

int64_t size() { return tls_team != nullptr ? tls_team->size() : 1; }

void run(int64_t begin, int64_t end, int64_t chunk, int64_t tasks, RangeFn fn, const void* ctx) {
  tls_team->run(begin, end, chunk, tasks, fn, ctx);
}

}  // namespace team

StepTeam::StepTeam() {
  (void)g_atfork;
  if (tls_role != team::Role::kNone || !team_enabled()) return;
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || !g_mutex->try_lock()) return;
  owner_ = true;
  if (g_team != nullptr && g_team->size() != threads) {  // torch's thread count changed
    delete g_team;
    g_team = nullptr;
  }
  if (g_team == nullptr) g_team = new Team(threads);
  g_team->set_policy(static_cast<int64_t>(env_us("RADIXSERVE_TEAM_YIELD_US", 4.0) * 1000.0),
                     static_cast<int64_t>(env_us("RADIXSERVE_TEAM_SLEEP_US", 100.0) * 1000.0));
  g_team->wake();
  tls_team = g_team;
  tls_role = team::Role::kMaster;
  g_steps.fetch_add(1, std::memory_order_relaxed);
}

StepTeam::~StepTeam() {
  if (!owner_) return;
  g_team->park();
  tls_team = nullptr;
  tls_role = team::Role::kNone;
  g_mutex->unlock();
}

bool step_team_enter() {
  if (tls_held != nullptr || tls_role != team::Role::kNone) return false;
  auto* held = new StepTeam();
  if (tls_role != team::Role::kMaster) {  // it took no team (off, one thread, another step's)
    delete held;
    return false;
  }
  tls_held = held;
  return true;
}

void step_team_exit() {
  delete std::exchange(tls_held, nullptr);
}

std::vector<int64_t> step_team_stats() {
  return {g_steps.load(), g_regions.load(), g_worker_chunks.load(), g_team != nullptr ? g_team->size() : 0};
}

std::vector<std::pair<int64_t, int64_t>> step_team_probe(int64_t n, int64_t grain, int64_t throw_at) {
  std::mutex m;
  std::vector<std::pair<int64_t, int64_t>> chunks;
  StepTeam step;
  rs::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    {
      std::lock_guard<std::mutex> lock(m);
      chunks.emplace_back(b, e);
    }
    // Sleeps a little so that a worker gets chunks too, not only the caller.
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    TORCH_CHECK(throw_at < b || throw_at >= e, "step_team_probe: chunk [", b, ", ", e, ") throws");
  });
  std::sort(chunks.begin(), chunks.end());
  return chunks;
}

}  // namespace rs
