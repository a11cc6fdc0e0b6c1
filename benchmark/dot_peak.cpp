// The rate one thread issues the dot-product instructions the CPU kernels are built on, measured:
// the ceiling their "share of peak" is read against on the machine at hand (a VM's vCPU may run
// below the core's nominal clock, or share its pipes with a sibling).
//
//   g++ -O2 -march=native benchmark/dot_peak.cpp -o /tmp/dot_peak && /tmp/dot_peak
//
// Each loop runs 24 independent accumulator chains (more than latency x throughput of any of
// these), timed by the thread's CPU time, and prints ns per instruction and the multiply-adds per
// second that stands for: vdpbf16ps zmm (bf16 attention tiles, 32 multiply-adds), vpdpbusd zmm
// (int8 VNNI, 64; its ymm form, 32, is what the wq_a8 GEMM tiles issue), vfmadd zmm (fp32 tiles, 16)
// and vfmadd ymm (the AVX2 builds, 8).
#include <immintrin.h>

#include <cstdio>
#include <ctime>

namespace {

constexpr int kChains = 24;
constexpr long kIters = 20000000;

double thread_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// Runs step(acc[i]) kChains x kIters times; the empty asm keeps every chain live and unfused, and
// the unrolled loop keeps the accumulators in registers (a loop over the array would store and
// reload each one a step, and measure the store-to-load latency instead).
template <typename Reg, typename Step>
void report(const char* name, int macs, Reg init, Step step) {
  Reg acc[kChains];
#pragma GCC unroll 32
  for (int i = 0; i < kChains; ++i) acc[i] = init;
  const double t0 = thread_seconds();
  for (long n = 0; n < kIters; ++n) {
#pragma GCC unroll 32
    for (int i = 0; i < kChains; ++i) {
      acc[i] = step(acc[i]);
      asm volatile("" : "+v"(acc[i]));
    }
  }
  const double ns = (thread_seconds() - t0) / (static_cast<double>(kIters) * kChains) * 1e9;
  std::printf("%-14s %.3f ns/instr  %6.1f G multiply-adds/s\n", name, ns, macs / ns);
}

}  // namespace

int main() {
#if defined(__AVX512BF16__)
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  report("vdpbf16ps zmm", 32, _mm512_setzero_ps(), [&](__m512 a) { return _mm512_dpbf16_ps(a, x, x); });
#endif
#if defined(__AVX512VNNI__)
  const __m512i b = _mm512_set1_epi8(1);
  report("vpdpbusd zmm", 64, _mm512_setzero_si512(), [&](__m512i a) { return _mm512_dpbusd_epi32(a, b, b); });
  const __m256i c = _mm256_set1_epi8(1);
  report("vpdpbusd ymm", 32, _mm256_setzero_si256(), [&](__m256i a) { return _mm256_dpbusd_epi32(a, c, c); });
#endif
#if defined(__AVX512F__)
  const __m512 f = _mm512_set1_ps(1.f);
  report("vfmadd zmm", 16, _mm512_setzero_ps(), [&](__m512 a) { return _mm512_fmadd_ps(a, f, f); });
#endif
  const __m256 g = _mm256_set1_ps(1.f);
  report("vfmadd ymm", 8, _mm256_setzero_ps(), [&](__m256 a) { return _mm256_fmadd_ps(a, g, g); });
  return 0;
}
