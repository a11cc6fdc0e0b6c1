// Collectives over shared memory for the ranks of one host: the hot-path replacement of gloo for
// tensor parallelism's per-layer all-reduce and the LM head's all-gather.
//
// Why: at decode a tensor-parallel layer all-reduces a few KB twice; gloo's TCP loopback round
// trip costs tens of microseconds per call, far more than the arithmetic. Here each rank copies its
// input into a shared region, publishes a sequence number, spins until every peer has published
// the same one, and reduces all inputs itself: one memcpy and a few cache-line transfers.
//
// Region (a file in /dev/shm that every rank maps; the Python side creates and unlinks it):
//   [RegionHeader][RankFlag x world]  (each on its own 128-byte line: no false sharing, not even
//                                      with the adjacent-line prefetcher)
//   [data: 2 buffers x world x slot_bytes]  (starting at a 4 KiB boundary)
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <string>

struct RegionHeader;
struct RankFlag;

class ShmComm {
 public:
  // Maps the region at `path`. With create, makes the file (it must not exist) and writes the
  // header; else attaches to one made by another rank with the same world_size and slot_bytes.
  ShmComm(const std::string& path, int64_t rank, int64_t world_size, int64_t slot_bytes, bool create,
          double timeout_s);
  ~ShmComm();
  ShmComm(const ShmComm&) = delete;
  ShmComm& operator=(const ShmComm&) = delete;

  // In place SUM over the ranks of a contiguous fp32 or bf16 CPU tensor (bf16 adds in fp32 and
  // rounds once). Every rank gets bit-identical results: inputs are summed in rank order 0..W-1.
  void all_reduce_(at::Tensor& t);
  // input [..., n] (contiguous, any dtype) -> [..., world * n], rank r's input at [r*n, (r+1)*n).
  at::Tensor all_gather(const at::Tensor& input);
  // Returns once every rank has called barrier() as many times (a collective with no data).
  void barrier();
  // Marks this rank closed (a peer waiting on it raises at once) and unmaps the region. Any later
  // call raises. Call it from the thread that runs the collectives.
  void close();

  // Whether every peer's process can be seen from here (/proc/<pid> with the start time it
  // attached with). Not when ranks run in different PID namespaces (containers that share
  // /dev/shm): then set check_peer_pids(false), and a dead peer is noticed by the timeout alone.
  bool peers_visible() const;
  bool check_peer_pids() const { return check_peer_pids_; }
  void set_check_peer_pids(bool check) { check_peer_pids_ = check; }

  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  double timeout_s() const { return timeout_s_; }
  void set_timeout_s(double timeout_s);
  // Collectives (chunks) run so far: the sequence number of the last one.
  int64_t seq() const { return static_cast<int64_t>(seq_); }
  bool closed() const { return base_ == nullptr; }
  static int64_t region_bytes(int64_t world_size, int64_t slot_bytes);

 private:
  char* slot(uint64_t seq, int64_t rank) const;
  // Publishes sequence number `seq` for this rank (its slot is written) and waits for every peer.
  void publish_and_wait(uint64_t seq);
  void wait_for_peers(uint64_t seq);
  void check_peers(uint64_t seq, std::chrono::steady_clock::duration waited);
  void check_usable(const char* op) const;
  [[noreturn]] void fail(const std::string& message);

  int64_t rank_, world_, slot_bytes_;
  double timeout_s_;
  uint64_t seq_ = 0;
  bool broken_ = false;
  bool check_peer_pids_ = true;  // a collective failed: the ranks' sequence numbers no longer agree
  size_t map_bytes_ = 0;
  char* base_ = nullptr;
  RegionHeader* header_ = nullptr;
  RankFlag* flags_ = nullptr;
  char* data_ = nullptr;
};
