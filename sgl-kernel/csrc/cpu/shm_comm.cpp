// ShmComm: the protocol, the region's mapping, and the waits that never hang (see shm_comm.h).
//
// One collective (or one slot-sized chunk of a large one) with sequence number s:
//   1. copy my input into slot[s % 2][rank]
//   2. flag[rank].seq = s                      (store-release: publishes the copy)
//   3. wait until flag[r].seq >= s for every r (load-acquire: the peers' copies are visible)
//   4. read slot[s % 2][0 .. world-1]          (reduce in rank order, or gather)
//
// Why two buffers suffice (the invariant): a rank writes buffer s % 2 in call s only after it
// passed step 3 of call s-1, i.e. after every peer published s-1, which each did only after it
// had finished reading call s-2's data, the last user of buffer s % 2. So a fast rank may run at
// most one call ahead, and what it writes is never the buffer a slow peer is still reading. Both
// directions are release/acquire pairs on the same flags (the data copy before my release, the
// peers' reads of call s-2 before their release of s-1), so there is no data race on the slots.
#include "shm_comm.h"

#include "thread_pool.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

constexpr uint64_t kMagic = 0x31636d6f63687372ULL;  // "rshcomc1"
constexpr size_t kLine = 128;                        // two cache lines: the adjacent-line prefetcher pairs them
constexpr size_t kDataAlign = 4096;
// Below this many bytes a copy or reduce runs on the calling thread: a decode step's few KB cost
// less than waking the OpenMP pool (tens of microseconds right after a GEMM).
constexpr int64_t kParallelGrainBytes = 256 << 10;
constexpr int64_t kBlock = 1024;  // elements summed per block: the fp32 accumulator stays in L1
constexpr int64_t kMaxWorld = 64;

// Waiting: spin with pause (the common case: a peer a few microseconds behind), then yield the
// core (ranks oversubscribing cores), then sleep (a peer stuck elsewhere: do not burn a core).
constexpr auto kSpinFor = std::chrono::microseconds(200);
constexpr auto kYieldFor = std::chrono::seconds(1);
constexpr auto kSleepStep = std::chrono::microseconds(50);
constexpr auto kCheckEvery = std::chrono::milliseconds(50);  // peers' liveness and the timeout

enum RankState : int32_t { kUnattached = 0, kAttached = 1, kClosed = 2 };

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// What /proc/<pid>/stat says of a process: whether it exists and runs (a zombie does not: kill(pid,
// 0) still succeeds on one, and a killed rank stays a zombie until its launcher waits on it), and
// when it started (clock ticks since boot: with the pid, an identity a reused pid does not share).
struct ProcInfo {
  bool alive;
  uint64_t start_ticks;  // 0: unknown
};

ProcInfo proc_info(int32_t pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return {false, 0};
    return {::kill(pid, 0) == 0 || errno == EPERM, 0};  // no /proc: the signal probe is all there is
  }
  char buf[1024];
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return {false, 0};  // the process went away between open and read
  buf[n] = '\0';
  // "pid (comm) S f4 f5 ...": comm may hold spaces and parentheses, so field 3 (the state) follows
  // the last ')', and field 22 (the start time) comes 19 fields after it.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr || p[1] == '\0' || p[2] == '\0') return {true, 0};
  p += 2;
  const bool alive = *p != 'Z' && *p != 'X' && *p != 'x';
  for (int field = 3; field < 22 && p != nullptr; ++field) {
    p = std::strchr(p, ' ');
    if (p != nullptr) ++p;
  }
  return {alive, p == nullptr ? 0 : std::strtoull(p, nullptr, 10)};
}

// Whether the process that attached as (pid, start_ticks) still runs.
bool peer_alive(int32_t pid, uint64_t start_ticks) {
  const ProcInfo info = proc_info(pid);
  return info.alive && (start_ticks == 0 || info.start_ticks == 0 || info.start_ticks == start_ticks);
}

inline int64_t grain_for(int64_t unit_bytes) {
  return std::max<int64_t>(1, kParallelGrainBytes / std::max<int64_t>(1, unit_bytes));
}

void copy_bytes(char* dst, const char* src, int64_t bytes) {
  constexpr int64_t kPiece = 64 << 10;
  const int64_t pieces = (bytes + kPiece - 1) / kPiece;
  rs::parallel_for(0, pieces, grain_for(kPiece), [&](int64_t b, int64_t e) {
    const int64_t lo = b * kPiece, hi = std::min(bytes, e * kPiece);
    std::memcpy(dst + lo, src + lo, hi - lo);
  });
}

inline float load_f(const float* p, int64_t i) { return p[i]; }
inline float load_f(const at::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }

// out[i] = ((in[0][i] + in[1][i]) + in[2][i]) + ...: the same order on every rank whatever the
// vector width or thread split, so all ranks hold the same bits.
template <typename T>
void sum_in_rank_order(T* out, const char* const* in, int64_t world, int64_t n) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  rs::parallel_for(0, blocks, grain_for(kBlock * sizeof(T) * world), [&](int64_t b, int64_t e) {
    alignas(64) float acc[kBlock];
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t lo = blk * kBlock, len = std::min(kBlock, n - lo);
      const T* first = reinterpret_cast<const T*>(in[0]) + lo;
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) acc[i] = load_f(first, i);
      for (int64_t r = 1; r < world; ++r) {
        const T* src = reinterpret_cast<const T*>(in[r]) + lo;
#pragma omp simd
        for (int64_t i = 0; i < len; ++i) acc[i] += load_f(src, i);
      }
      T* dst = out + lo;
      for (int64_t i = 0; i < len; ++i) dst[i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

struct alignas(kLine) RegionHeader {
  std::atomic<uint64_t> magic;  // written last by the creator (release): the rest is valid
  int64_t world_size;
  int64_t slot_bytes;
};

struct alignas(kLine) RankFlag {
  std::atomic<uint64_t> seq;   // the last collective this rank published
  std::atomic<int32_t> pid;    // who holds the rank (for the liveness checks)
  std::atomic<int32_t> state;  // RankState
  std::atomic<uint64_t> start_ticks;  // the holder's start time (so a reused pid reads as dead)
};

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<int32_t>::is_always_lock_free,
              "the flags live in shared memory: their atomics must be lock-free (address-free)");

namespace {

size_t data_offset(int64_t world) {
  const size_t head = sizeof(RegionHeader) + sizeof(RankFlag) * static_cast<size_t>(world);
  return (head + kDataAlign - 1) / kDataAlign * kDataAlign;
}

std::string errno_text(const char* what, const std::string& path) {
  std::ostringstream os;
  os << "ShmComm: " << what << " " << path << ": " << std::strerror(errno);
  return os.str();
}

// Opens (or with create, makes and reserves) the region file and maps it shared; raises with the
// reason, removing a file it made, on any failure.
void* map_region(const std::string& path, size_t bytes, bool create) {
  const int fd = create ? ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600)
                        : ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, errno_text(create ? "cannot create" : "cannot open", path));
  std::string error;
  struct stat st {};
  if (create && ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    error = errno_text("cannot size", path);
  } else if (const int err = create ? ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)) : 0; err != 0) {
    // Reserve the pages now: a tmpfs too small for the region (a container's 64 MiB /dev/shm)
    // fails here with ENOSPC instead of killing a rank with SIGBUS at its first large collective.
    errno = err;
    error = errno_text("cannot reserve memory for", path);
  } else if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    error = "ShmComm: " + path + " does not have the size world_size and slot_bytes imply";
  }
  void* mem = MAP_FAILED;
  if (error.empty()) {
    mem = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (mem == MAP_FAILED) error = errno_text("cannot map", path);
  }
  ::close(fd);  // the mapping keeps the region alive; the file is unlinked once all ranks attach
  if (!error.empty()) {
    if (create) ::unlink(path.c_str());
    TORCH_CHECK(false, error);
  }
  return mem;
}

}  // namespace

int64_t ShmComm::region_bytes(int64_t world_size, int64_t slot_bytes) {
  return static_cast<int64_t>(data_offset(world_size)) + 2 * world_size * slot_bytes;
}

ShmComm::ShmComm(const std::string& path, int64_t rank, int64_t world_size, int64_t slot_bytes, bool create,
                 double timeout_s)
    : rank_(rank), world_(world_size), slot_bytes_(slot_bytes), timeout_s_(timeout_s) {
  TORCH_CHECK(world_size >= 1 && world_size <= kMaxWorld, "ShmComm: world_size must be in [1, ", kMaxWorld, "]");
  TORCH_CHECK(rank >= 0 && rank < world_size, "ShmComm: rank ", rank, " outside world of ", world_size);
  TORCH_CHECK(slot_bytes >= 64 && slot_bytes % 64 == 0, "ShmComm: slot_bytes must be a positive multiple of 64");
  set_timeout_s(timeout_s);
  map_bytes_ = static_cast<size_t>(region_bytes(world_size, slot_bytes));
  void* mem = map_region(path, map_bytes_, create);
  base_ = static_cast<char*>(mem);
  header_ = reinterpret_cast<RegionHeader*>(base_);
  flags_ = reinterpret_cast<RankFlag*>(base_ + sizeof(RegionHeader));
  data_ = base_ + data_offset(world_size);
  if (create) {  // a fresh file reads as zeros: every flag starts unattached at sequence 0
    header_->world_size = world_size;
    header_->slot_bytes = slot_bytes;
    header_->magic.store(kMagic, std::memory_order_release);
  } else if (header_->magic.load(std::memory_order_acquire) != kMagic || header_->world_size != world_size ||
             header_->slot_bytes != slot_bytes) {
    ::munmap(mem, map_bytes_);
    base_ = nullptr;
    TORCH_CHECK(false, "ShmComm: ", path, " was not made for world_size ", world_size, " and slot_bytes ",
                slot_bytes);
  }
  int32_t expected = kUnattached;
  if (!flags_[rank].state.compare_exchange_strong(expected, kAttached)) {
    base_ = nullptr;  // the rank belongs to someone else: leave its flag alone
    ::munmap(mem, map_bytes_);
    TORCH_CHECK(false, "ShmComm: rank ", rank, " of ", path, " is already attached");
  }
  flags_[rank].start_ticks.store(proc_info(::getpid()).start_ticks, std::memory_order_relaxed);
  flags_[rank].pid.store(static_cast<int32_t>(::getpid()), std::memory_order_release);
}

bool ShmComm::peers_visible() const {
  TORCH_CHECK(base_ != nullptr, "ShmComm.peers_visible: the communicator is closed");
  for (int64_t p = 0; p < world_; ++p) {
    const int32_t pid = flags_[p].pid.load(std::memory_order_acquire);
    if (p != rank_ && (pid <= 0 || !peer_alive(pid, flags_[p].start_ticks.load(std::memory_order_relaxed)))) {
      return false;
    }
  }
  return true;
}

ShmComm::~ShmComm() { close(); }

void ShmComm::close() {
  if (base_ == nullptr) return;
  flags_[rank_].state.store(kClosed, std::memory_order_release);
  ::munmap(base_, map_bytes_);
  base_ = nullptr;
  header_ = nullptr;
  flags_ = nullptr;
  data_ = nullptr;
}

void ShmComm::set_timeout_s(double timeout_s) {
  TORCH_CHECK(timeout_s > 0, "ShmComm: timeout_s must be positive");
  timeout_s_ = timeout_s;
}

char* ShmComm::slot(uint64_t seq, int64_t rank) const {
  return data_ + ((static_cast<int64_t>(seq % 2) * world_ + rank) * slot_bytes_);
}

void ShmComm::check_usable(const char* op) const {
  TORCH_CHECK(base_ != nullptr, "ShmComm.", op, ": the communicator is closed");
  TORCH_CHECK(!broken_, "ShmComm.", op, ": an earlier collective failed; the ranks are out of step");
}

void ShmComm::fail(const std::string& message) {
  broken_ = true;
  throw std::runtime_error(message);
}

void ShmComm::publish_and_wait(uint64_t seq) {
  flags_[rank_].seq.store(seq, std::memory_order_release);
  wait_for_peers(seq);
}

void ShmComm::wait_for_peers(uint64_t seq) {
  using Clock = std::chrono::steady_clock;
  Clock::time_point start{}, next_check{};
  uint64_t spins = 0;
  enum class Backoff { kSpin, kYield, kSleep } backoff = Backoff::kSpin;
  for (int64_t r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const std::atomic<uint64_t>& flag = flags_[r].seq;
    while (flag.load(std::memory_order_acquire) < seq) {
      // Spinning reads the clock once every 64 pauses (a pause is ~10-150 cycles); once yielding
      // or sleeping, a syscall per round costs more than the clock anyway.
      if (backoff == Backoff::kSpin && (++spins & 63) != 0) {
        cpu_relax();
        continue;
      }
      const Clock::time_point now = Clock::now();
      if (start == Clock::time_point{}) {
        start = now;
        next_check = now + kCheckEvery;
      }
      const auto waited = now - start;
      if (now >= next_check) {
        next_check = now + kCheckEvery;
        check_peers(seq, waited);
      }
      backoff = waited < kSpinFor ? Backoff::kSpin : waited < kYieldFor ? Backoff::kYield : Backoff::kSleep;
      if (backoff == Backoff::kYield) {
        ::sched_yield();
      } else if (backoff == Backoff::kSleep) {
        std::this_thread::sleep_for(kSleepStep);
      } else {
        cpu_relax();
      }
    }
  }
}

// Raises when a peer that has not reached `seq` exited or closed, or the wait passed the timeout.
void ShmComm::check_peers(uint64_t seq, std::chrono::steady_clock::duration waited) {
  for (int64_t p = 0; p < world_; ++p) {
    if (p == rank_ || flags_[p].seq.load(std::memory_order_acquire) >= seq) continue;
    const int32_t state = flags_[p].state.load(std::memory_order_acquire);
    const int32_t pid = flags_[p].pid.load(std::memory_order_acquire);
    std::ostringstream os;
    os << "ShmComm: rank " << p << " (pid " << pid << ") ";
    if (state == kClosed) {
      os << "closed its communicator while rank " << rank_ << " waited in collective #" << seq;
      fail(os.str());
    }
    if (check_peer_pids_ && state == kAttached && pid > 0 &&
        !peer_alive(pid, flags_[p].start_ticks.load(std::memory_order_relaxed))) {
      os << "exited while rank " << rank_ << " waited in collective #" << seq;
      fail(os.str());
    }
  }
  if (std::chrono::duration<double>(waited).count() > timeout_s_) {
    std::ostringstream os;
    os << "ShmComm: rank " << rank_ << " timed out after " << timeout_s_ << " s in collective #" << seq
       << " waiting for";
    for (int64_t p = 0; p < world_; ++p) {
      if (p != rank_ && flags_[p].seq.load(std::memory_order_acquire) < seq) {
        os << " rank " << p << " (pid " << flags_[p].pid.load() << ")";
      }
    }
    fail(os.str());
  }
}

void ShmComm::all_reduce_(at::Tensor& t) {
  check_usable("all_reduce_");
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              "ShmComm.all_reduce_: expected a contiguous float32 or bfloat16 CPU tensor");
  const int64_t elem = t.element_size(), n = t.numel(), chunk = slot_bytes_ / elem;
  char* base = static_cast<char*>(t.data_ptr());
  const char* in[kMaxWorld];
  const bool bf16 = t.scalar_type() == at::kBFloat16;
  for (int64_t off = 0; off < n; off += chunk) {
    const int64_t len = std::min(chunk, n - off);
    const uint64_t s = ++seq_;
    copy_bytes(slot(s, rank_), base + off * elem, len * elem);
    publish_and_wait(s);
    for (int64_t r = 0; r < world_; ++r) in[r] = slot(s, r);
    if (bf16) {
      sum_in_rank_order(reinterpret_cast<at::BFloat16*>(base) + off, in, world_, len);
    } else {
      sum_in_rank_order(reinterpret_cast<float*>(base) + off, in, world_, len);
    }
  }
}

at::Tensor ShmComm::all_gather(const at::Tensor& input) {
  check_usable("all_gather");
  TORCH_CHECK(input.device().is_cpu() && input.is_contiguous() && input.dim() >= 1,
              "ShmComm.all_gather: expected a contiguous CPU tensor with at least one dimension");
  std::vector<int64_t> sizes = input.sizes().vec();
  const int64_t row_bytes = sizes.back() * input.element_size();
  sizes.back() *= world_;
  at::Tensor out = at::empty(sizes, input.options());
  const int64_t total = input.numel() * input.element_size();
  const int64_t chunk = slot_bytes_ / input.element_size() * input.element_size();
  const char* src = static_cast<const char*>(input.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t out_row = row_bytes * world_;
  for (int64_t off = 0; off < total; off += chunk) {
    const int64_t len = std::min(chunk, total - off);
    const uint64_t s = ++seq_;
    copy_bytes(slot(s, rank_), src + off, len);
    publish_and_wait(s);
    // Input bytes [off, off + len) of every rank land in the rows they cover, each rank's in its
    // column block; a chunk may start or end inside a row.
    const int64_t row_lo = off / row_bytes, row_hi = (off + len - 1) / row_bytes + 1;
    rs::parallel_for(row_lo, row_hi, grain_for(out_row), [&](int64_t b, int64_t e) {
      for (int64_t row = b; row < e; ++row) {
        const int64_t lo = std::max(off, row * row_bytes), hi = std::min(off + len, (row + 1) * row_bytes);
        for (int64_t r = 0; r < world_; ++r) {
          std::memcpy(dst + row * out_row + r * row_bytes + (lo - row * row_bytes), slot(s, r) + (lo - off), hi - lo);
        }
      }
    });
  }
  return out;
}

void ShmComm::barrier() {
  check_usable("barrier");
  publish_and_wait(++seq_);
}
