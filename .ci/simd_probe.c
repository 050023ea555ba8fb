/* Which x86-64 vector extensions this machine can actually *run*, for building the llama.cpp peer.
 *
 * cpuid (and so /proc/cpuinfo and -march=native) can list an extension the machine cannot execute: some
 * virtual machines list AMX tiles whose state the hypervisor never enables, and a -march=native build of
 * llama.cpp then crashes at its first decode. So each extension is tried here: a small computation with
 * one of its instructions runs in a forked child, and the extension counts only if the child exits normally
 * with the right answer (a SIGILL or SIGSEGV in the child marks it unusable; the parent never faults).
 *
 * Prints one line per extension, "NAME ok" or "NAME no (why)", in the order of the GGML_* CMake options.
 * Build: cc -O1 -o simd_probe simd_probe.c   (GCC >= 11 or clang >= 12, for the AMX and AVX-VNNI intrinsics)
 */
#include <immintrin.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define T(x) __attribute__((target(x), noinline))

/* Each check returns 1 when its instruction ran and gave the expected result (AMX: -1 when the kernel refuses
 * the tile state). volatile inputs keep the
 * compiler from folding the computation away at build time. */
static volatile int32_t vi[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
static volatile float vf[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};

T("sse4.2") static int sse42(void) { return _mm_crc32_u32(0, (uint32_t)vi[0]) == 0xdd45aab8u; }

T("avx") static int avx(void) {
  __m256 a = _mm256_set1_ps(vf[1]);
  float o[8];
  _mm256_storeu_ps(o, _mm256_add_ps(a, a));
  return o[7] == 4.0f;
}

T("avx2") static int avx2(void) {
  __m256i a = _mm256_set1_epi32(vi[2]);
  int32_t o[8];
  _mm256_storeu_si256((__m256i *)o, _mm256_mullo_epi32(a, a));
  return o[5] == 9;
}

T("fma") static int fma_(void) {
  __m256 a = _mm256_set1_ps(vf[2]);
  float o[8];
  _mm256_storeu_ps(o, _mm256_fmadd_ps(a, a, a));
  return o[0] == 12.0f;
}

T("f16c") static int f16c(void) {
  __m128i h = _mm_cvtps_ph(_mm_set1_ps(vf[4]), 0);
  float o[4];
  _mm_storeu_ps(o, _mm_cvtph_ps(h));
  return o[3] == 5.0f;
}

T("bmi2") static int bmi2(void) { return _pdep_u64((uint64_t)vi[2], 0xf0) == 0x30; }

T("avxvnni") static int avxvnni(void) {
  __m256i a = _mm256_set1_epi8((char)vi[1]), b = _mm256_set1_epi8((char)vi[2]);
  int32_t o[8];
  _mm256_storeu_si256((__m256i *)o, _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b));
  return o[1] == 24;
}

/* GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw: all five must run. */
T("avx512f,avx512cd,avx512vl,avx512dq,avx512bw") static int avx512(void) {
  __m512i a = _mm512_set1_epi32(vi[3]);
  __m512i c = _mm512_conflict_epi32(a);                                 /* cd */
  __m512i s = _mm512_add_epi8(a, a);                                    /* bw */
  __m512d d = _mm512_cvtepi64_pd(_mm512_set1_epi64(vi[6]));             /* dq */
  __m256i v = _mm256_mask_add_epi32(_mm256_setzero_si256(), 0xff,       /* vl */
                                    _mm256_set1_epi32(vi[0]), _mm256_set1_epi32(vi[0]));
  int32_t oc[16], os[16], ov[8];
  double od[8];
  _mm512_storeu_si512(oc, c);
  _mm512_storeu_si512(os, s);
  _mm512_storeu_pd(od, d);
  _mm256_storeu_si256((__m256i *)ov, v);
  return oc[15] == 0x7fff && os[0] == 8 && od[7] == 7.0 && ov[7] == 2;
}

T("avx512f,avx512vbmi") static int avx512vbmi(void) {
  __m512i idx = _mm512_set1_epi8((char)vi[0]);
  __m512i t = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x0000ab00 | vi[0]);
  uint8_t o[64];
  _mm512_storeu_si512(o, _mm512_permutexvar_epi8(idx, t));
  return o[63] == 0xab;
}

T("avx512f,avx512vnni") static int avx512vnni(void) {
  __m512i a = _mm512_set1_epi8((char)vi[1]), b = _mm512_set1_epi8((char)vi[2]);
  int32_t o[16];
  _mm512_storeu_si512(o, _mm512_dpbusd_epi32(_mm512_setzero_si512(), a, b));
  return o[15] == 24;
}

T("avx512f,avx512bf16") static int avx512bf16(void) {
  __m512 a = _mm512_set1_ps(vf[2]);
  __m512bh p = _mm512_cvtne2ps_pbh(a, a);
  __m512 o = _mm512_dpbf16_ps(_mm512_setzero_ps(), p, p); /* two products of 3*3 per lane */
  float r[16];
  _mm512_storeu_ps(r, o);
  return r[9] == 18.0f;
}

/* AMX: the process must first ask the kernel for the tile-data state (as ggml does), then configure tiles
 * and run a tile dot product. A machine that lists AMX but never enabled its state fails here. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
struct tilecfg {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static int amx_perm(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

T("amx-tile") static void amx_config(void) {
  struct tilecfg cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 3; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
}

T("amx-tile") static int amx_tile(void) {
  if (!amx_perm()) return -1;
  static int32_t c[16 * 16];
  amx_config();
  _tile_zero(0);
  _tile_stored(0, c, 64);
  _tile_release();
  return c[255] == 0;
}

T("amx-tile,amx-int8") static int amx_int8(void) {
  if (!amx_perm()) return -1;
  static int8_t a[16 * 64], b[16 * 64];
  static int32_t c[16 * 16];
  for (int i = 0; i < 16 * 64; i++) { a[i] = (int8_t)vi[1]; b[i] = (int8_t)vi[2]; }
  amx_config();
  _tile_zero(0);
  _tile_loadd(1, a, 64);
  _tile_loadd(2, b, 64);
  _tile_dpbssd(0, 1, 2);
  _tile_stored(0, c, 64);
  _tile_release();
  return c[255] == 64 * 2 * 3;
}

T("amx-tile,amx-bf16") static int amx_bf16(void) {
  if (!amx_perm()) return -1;
  static uint16_t a[16 * 32], b[16 * 32];
  static float c[16 * 16];
  for (int i = 0; i < 16 * 32; i++) { a[i] = 0x4000; b[i] = 0x4040; } /* bf16 2.0 and 3.0 */
  amx_config();
  _tile_zero(0);
  _tile_loadd(1, a, 64);
  _tile_loadd(2, b, 64);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, c, 64);
  _tile_release();
  return c[255] == 32 * 2.0f * 3.0f;
}

static const struct { const char *name; int (*fn)(void); } checks[] = {
    {"SSE42", sse42},           {"AVX", avx},
    {"AVX2", avx2},             {"FMA", fma_},
    {"F16C", f16c},             {"BMI2", bmi2},
    {"AVX_VNNI", avxvnni},      {"AVX512", avx512},
    {"AVX512_VBMI", avx512vbmi}, {"AVX512_VNNI", avx512vnni},
    {"AVX512_BF16", avx512bf16}, {"AMX_TILE", amx_tile},
    {"AMX_INT8", amx_int8},     {"AMX_BF16", amx_bf16},
};

int main(void) {
  for (size_t i = 0; i < sizeof checks / sizeof checks[0]; i++) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
      int r = checks[i].fn();
      _exit(r == 1 ? 0 : r == -1 ? 4 : 3);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
      printf("%s ok\n", checks[i].name);
    else if (WIFSIGNALED(st))
      printf("%s no (%s)\n", checks[i].name, strsignal(WTERMSIG(st)));
    else if (WIFEXITED(st) && WEXITSTATUS(st) == 4)
      printf("%s no (the kernel refused the tile state)\n", checks[i].name);
    else
      printf("%s no (wrong result)\n", checks[i].name);
  }
  return 0;
}
