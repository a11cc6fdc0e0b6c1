// How long one iteration of GNU OpenMP's spin-wait takes on this CPU, so radixserve can give
// GOMP_SPINCOUNT in time rather than in iterations (radixserve/utils/cpus.py). libgomp's wait
// loop is a relaxed load of the flag it waits on and a cpu_relax() (PAUSE on x86), and PAUSE
// takes from ~5 ns to ~50 ns depending on the CPU generation and vendor, so a fixed count spins
// ten times longer on one machine than on another.
//
// A plain C library with no Python or torch dependency: it is loaded with ctypes before torch
// (whose OpenMP runtime reads GOMP_SPINCOUNT once, when it loads).
#include <stdatomic.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPIN_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define SPIN_RELAX() __asm__ __volatile__("yield" ::: "memory")
#else
#define SPIN_RELAX() __asm__ __volatile__("" ::: "memory")
#endif

static double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

// Nanoseconds per iteration of a libgomp-like spin loop: the fastest of `rounds` timings of
// `iters` iterations (the fastest, since an interruption only ever adds time).
double spin_iteration_ns(long iters, int rounds) {
  static _Atomic int flag = 0;
  double best = -1.0;
  for (int r = 0; r < rounds; ++r) {
    const double t0 = now_ns();
    for (long i = 0; i < iters; ++i) {
      if (atomic_load_explicit(&flag, memory_order_relaxed) != 0) break;
      SPIN_RELAX();
    }
    const double ns = (now_ns() - t0) / (double)iters;
    if (best < 0 || ns < best) best = ns;
  }
  return best;
}
