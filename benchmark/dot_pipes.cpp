// Which vector ops share vpdpbusd's pipes: 16 independent vpdpbusd ymm chains alone, then with 8
// independent chains of another op beside them, in ns per iteration (inline asm, so the compiler
// neither spills nor reorders). An op on other pipes leaves the time at the dots' alone; one on
// the same pipes adds its own cost (vpdpbusd ymm at 2 a cycle: ~0.14 ns each on a ~3.6 GHz core).
// On Zen 4 (AMD EPYC family 25 model 17, 2026-12-02): vfmadd and vmulps add their full cost
// (the wq_a8 GEMM tiles' epilogue competes with their dots), vaddps, vpand, vcvtdq2ps, vcvtph2ps
// and vpsrlw are free, broadcasts from memory near free. docs/cpu_backend.md reads it.
//
//   g++ -O2 -march=native benchmark/dot_pipes.cpp -o /tmp/dot_pipes && /tmp/dot_pipes
#include <cstdio>
#include <ctime>

namespace {

constexpr long kIters = 20000000;

double thread_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define DP(r) "vpdpbusd %%ymm31, %%ymm30, %%ymm" #r "\n"
#define D16 DP(0) DP(1) DP(2) DP(3) DP(4) DP(5) DP(6) DP(7) DP(8) DP(9) DP(10) DP(11) DP(12) DP(13) DP(14) DP(15)
// Three-operand op on ymm16..23 (chains), with ymm29 as the other source.
#define X(op, r) op " %%ymm29, %%ymm" #r ", %%ymm" #r "\n"
#define X8(op) X(op, 16) X(op, 17) X(op, 18) X(op, 19) X(op, 20) X(op, 21) X(op, 22) X(op, 23)
// Two-operand op (source and destination the chain's register).
#define U(op, r) op " %%ymm" #r ", %%ymm" #r "\n"
#define U8(op) U(op, 16) U(op, 17) U(op, 18) U(op, 19) U(op, 20) U(op, 21) U(op, 22) U(op, 23)
// An op from memory (%0) into the chain's register.
#define M(op, r, at) op " " #at "(%0), %%ymm" #r "\n"
#define M8(op) M(op, 16, 0) M(op, 17, 4) M(op, 18, 8) M(op, 19, 12) M(op, 20, 16) M(op, 21, 20) M(op, 22, 24) M(op, 23, 28)

alignas(64) int buffer[64];

#define RUN(name, body)                                                                 \
  {                                                                                     \
    const int* at = buffer;                                                             \
    const double t0 = thread_seconds();                                                 \
    for (long n = 0; n < kIters; ++n) asm volatile(body ::"r"(at) : "memory");          \
    const double ns = (thread_seconds() - t0) / kIters * 1e9;                           \
    std::printf("%-28s %.3f ns/iteration (%.1f vpdpbusd at 0.14 ns)\n", name, ns, ns / 0.14); \
  }

}  // namespace

int main() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  asm volatile("vpxord %%ymm29, %%ymm29, %%ymm29\n vpxord %%ymm30, %%ymm30, %%ymm30\n vpxord %%ymm31, %%ymm31, %%ymm31\n" ::
                   : "memory");
  RUN("16 vpdpbusd", D16)
  RUN("16 vpdpbusd + 8 vfmadd231ps", D16 X8("vfmadd231ps"))
  RUN("16 vpdpbusd + 8 vmulps", D16 X8("vmulps"))
  RUN("16 vpdpbusd + 8 vaddps", D16 X8("vaddps"))
  RUN("16 vpdpbusd + 8 vpandd", D16 X8("vpandd"))
  RUN("16 vpdpbusd + 8 vpsrlw", D16 U8("vpsrlw $4,"))
  RUN("16 vpdpbusd + 8 vcvtdq2ps", D16 U8("vcvtdq2ps"))
  RUN("16 vpdpbusd + 8 vcvtph2ps m", D16 M8("vcvtph2ps"))
  RUN("16 vpdpbusd + 8 vpbroadcastd m", D16 M8("vpbroadcastd"))
  RUN("16 vfmadd231ps", X8("vfmadd231ps") X8("vfmadd231ps"))
#else
  std::printf("needs AVX512_VNNI and AVX512VL (-march=native on such a CPU)\n");
#endif
  return 0;
}
