// The native decode kernel's arithmetic: element loads (f32, bf16, int8, fp8), the group dot
// and value update (AVX2/FMA chosen at run time, a portable path elsewhere) and the online
// softmax of one work item: some query rows x one kv head's group of query heads over a
// sequence of key blocks. The FFI handlers (handlers.cc) say which rows, blocks and keys.
//
// Glossary: RG = rows x group heads of an item (each a query vector), D key size, Dv value
// size, a block = up to kMaxSlots consecutive keys of one kv head (a page, or a cache's run).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define SPLASH_X86 1
#define SPLASH_AVX2 __attribute__((target("avx2,fma,f16c")))
#define SPLASH_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#else
#define SPLASH_X86 0
#endif

namespace splash_native {

constexpr int kMaxSlots = 64;   // keys of a block (pages larger than this are read in parts)
constexpr int kMaxRows = 8;     // query rows of one item
#ifndef SPLASH_PREFETCH_BLOCKS
#define SPLASH_PREFETCH_BLOCKS 1
#endif
constexpr int kPrefetchBlocks = SPLASH_PREFETCH_BLOCKS;  // how far ahead blocks are prefetched
constexpr int kMaxGroup = 16;   // query heads per kv head
constexpr int kMaxRG = kMaxRows * kMaxGroup;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Storage types of keys and values, by the bits they hold.
struct Bf16 { uint16_t bits; };
struct F16 { uint16_t bits; };
struct E4m3 { uint8_t bits; };
struct E5m2 { uint8_t bits; };

inline float Bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float Fp8(uint8_t x, int mantissa_bits, int bias, bool fn) {
  const int exp_bits = 7 - mantissa_bits;
  const int e = (x >> mantissa_bits) & ((1 << exp_bits) - 1), m = x & ((1 << mantissa_bits) - 1);
  const float sign = (x & 0x80) ? -1.0f : 1.0f;
  if (fn ? (e == (1 << exp_bits) - 1 && m == (1 << mantissa_bits) - 1) : e == (1 << exp_bits) - 1)
    return (!fn && m == 0) ? sign * INFINITY : NAN;
  const float frac = static_cast<float>(m) / static_cast<float>(1 << mantissa_bits);
  return e == 0 ? sign * std::ldexp(frac, 1 - bias) : sign * std::ldexp(1.0f + frac, e - bias);
}

inline float ToF32(float x) { return x; }
inline float ToF32(Bf16 x) { return Bits(static_cast<uint32_t>(x.bits) << 16); }
inline float ToF32(F16 x) {
  const int e = (x.bits >> 10) & 0x1f, m = x.bits & 0x3ff;
  const float sign = (x.bits & 0x8000) ? -1.0f : 1.0f;
  if (e == 0x1f) return m ? NAN : sign * INFINITY;
  return e == 0 ? sign * std::ldexp(static_cast<float>(m), -24)
                : sign * std::ldexp(1.0f + static_cast<float>(m) / 1024.0f, e - 15);
}
inline float ToF32(int8_t x) { return static_cast<float>(x); }
inline float ToF32(E4m3 x) { return Fp8(x.bits, 3, 7, true); }
inline float ToF32(E5m2 x) { return Fp8(x.bits, 2, 15, false); }

#ifndef SPLASH_PREFETCH_LOCALITY
#define SPLASH_PREFETCH_LOCALITY 2  // into L2 (prefetcht1): measured best here
#endif
// Prefetches the cache line holding `p`. On x86 a volatile asm: GCC deletes a loop whose only
// statements are __builtin_prefetch when it cannot count its trips (seen: every key and value
// prefetch of the kernel gone from the binary).
inline void PrefetchLine(const char* p) {
#if SPLASH_X86 && SPLASH_PREFETCH_LOCALITY == 3
  asm volatile("prefetcht0 %0" : : "m"(*p));
#elif SPLASH_X86 && SPLASH_PREFETCH_LOCALITY == 2
  asm volatile("prefetcht1 %0" : : "m"(*p));
#elif SPLASH_X86 && SPLASH_PREFETCH_LOCALITY == 1
  asm volatile("prefetcht2 %0" : : "m"(*p));
#elif SPLASH_X86
  asm volatile("prefetchnta %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, SPLASH_PREFETCH_LOCALITY);
#endif
}

// Prefetches `bytes` from `p` into the cache (reads ahead of the block being folded).
inline void Prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) PrefetchLine(c + i);
}

// Rows of the next block to read ahead (`rows` rows of `row_bytes`, `stride` bytes apart),
// prefetched in equal shares spread over a loop's passes: a burst of prefetches stalls the
// core until memory drains them, a steady stream runs beside the arithmetic.
struct Ahead {
  const char* base = nullptr;
  int64_t stride = 0;
  int rows = 0, row_lines = 0;
  Ahead() = default;
  Ahead(const void* p, int64_t stride_bytes, int nrows, int64_t row_bytes)
      : base(static_cast<const char*>(p)), stride(stride_bytes), rows(nrows),
        row_lines(static_cast<int>((row_bytes + 63) / 64)) {}
  // Share k of `parts` (k in [0, parts)).
  void Share(int k, int parts) const {
    const int total = rows * row_lines, from = total * k / parts, to = total * (k + 1) / parts;
    for (int x = from, r = from / std::max(row_lines, 1), c = from - r * row_lines; x < to; ++x) {
      PrefetchLine(base + r * stride + c * 64);
      if (++c == row_lines) c = 0, ++r;
    }
  }
};

// ---- portable: one element at a time ----
template <typename T>
void DotGroupPortable(const float* q, int rg, const T* k, int d, float* out) {
  for (int i = 0; i < rg; ++i) {
    float s = 0.0f;
    for (int c = 0; c < d; ++c) s += q[i * d + c] * ToF32(k[c]);
    out[i] = s;
  }
}

template <typename T>
void AxpyGroupPortable(const float* coeff, const uint8_t* take, int rg, const T* v, int dv,
                       float* acc) {
  for (int i = 0; i < rg; ++i) {
    if (!take[i]) continue;
    for (int c = 0; c < dv; ++c) acc[i * dv + c] += coeff[i] * ToF32(v[c]);
  }
}

#if SPLASH_X86
// ---- AVX2/FMA: eight lanes; a tail (d % 8) element by element ----
SPLASH_AVX2 inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
SPLASH_AVX2 inline __m256 Load8(const Bf16* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
SPLASH_AVX2 inline __m256 Load8(const F16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
SPLASH_AVX2 inline __m256 Load8(const int8_t* p) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
SPLASH_AVX2 inline __m256 Load8(const E5m2* p) {  // e5m2 is the top byte of a float16
  __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
}
SPLASH_AVX2 inline __m256 Load8(const E4m3* p) {  // as a float16 of exponent bias 15, x 2^8
  __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7f));
  __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                           _mm_slli_epi16(mag, 7));
  __m128i nan = _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f));  // e4m3fn's one NaN per sign
  h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7e00)));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}

SPLASH_AVX2 inline float Sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// out[i] = q[i] . k over d, four query vectors per pass over k, two accumulators each (eight
// independent FMA chains: one chain per vector waits on the FMA's latency).
template <typename T>
SPLASH_AVX2 void DotGroupAvx2(const float* q, int rg, const T* k, int d, float* out) {
  const int body = d & ~15, body8 = d & ~7;
  int i = 0;
  for (; i + 4 <= rg; i += 4) {
    __m256 a[8];
    for (int x = 0; x < 8; ++x) a[x] = _mm256_setzero_ps();
    const float* q0 = q + i * d;
    for (int c = 0; c < body; c += 16) {
      const __m256 k0 = Load8(k + c), k1 = Load8(k + c + 8);
      for (int x = 0; x < 4; ++x) {
        a[x] = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + x * d + c), k0, a[x]);
        a[4 + x] = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + x * d + c + 8), k1, a[4 + x]);
      }
    }
    if (body < body8) {
      const __m256 k0 = Load8(k + body);
      for (int x = 0; x < 4; ++x) a[x] = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + x * d + body), k0, a[x]);
    }
    const __m256 t = _mm256_hadd_ps(  // the four sums at once: lanes [v0 v1 v2 v3 | same]
        _mm256_hadd_ps(_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[1], a[5])),
        _mm256_hadd_ps(_mm256_add_ps(a[2], a[6]), _mm256_add_ps(a[3], a[7])));
    _mm_storeu_ps(out + i, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  }
  for (; i < rg; ++i) {
    __m256 a = _mm256_setzero_ps();
    for (int c = 0; c < body8; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * d + c),
                                                           Load8(k + c), a);
    out[i] = Sum8(a);
  }
  for (int c = body8; c < d; ++c) {
    const float kc = ToF32(k[c]);
    for (int j = 0; j < rg; ++j) out[j] += q[j * d + c] * kc;
  }
}

// Adds columns [from, d) of q[i] . ka and q[i] . kb to out_a / out_b (a dot's tail).
template <typename T>
void DotPairTail(const float* q, int rg, const T* ka, const T* kb, int d, int from,
                 float* out_a, float* out_b) {
  for (int c = from; c < d; ++c) {
    const float xa = ToF32(ka[c]), xb = ToF32(kb[c]);
    for (int j = 0; j < rg; ++j)
      out_a[j * kMaxSlots] += q[j * d + c] * xa, out_b[j * kMaxSlots] += q[j * d + c] * xb;
  }
}

// Four vectors' sums of two keys from hadd trees t and u (lanes [v0 v1 v2 v3 | the same]):
// out_a[x * kMaxSlots] and out_b[x * kMaxSlots] for x < 4.
SPLASH_AVX2 inline void StoreFours(__m256 t, __m256 u, float* out_a, float* out_b) {
  alignas(16) float sa[4], sb[4];
  _mm_store_ps(sa, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  _mm_store_ps(sb, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
  for (int x = 0; x < 4; ++x) out_a[x * kMaxSlots] = sa[x], out_b[x * kMaxSlots] = sb[x];
}

// out_a[i * kMaxSlots] = q[i] . ka and out_b[...] = q[i] . kb: two keys at once, four query
// vectors a pass (eight FMA chains; each query load serves both keys).
template <typename T>
SPLASH_AVX2 void DotPairAvx2(const float* q, int rg, const T* ka, const T* kb, int d,
                             float* out_a, float* out_b) {
  const int body8 = d & ~7;
  int i = 0;
  for (; i + 4 <= rg; i += 4) {
    __m256 a[8];
    for (int x = 0; x < 8; ++x) a[x] = _mm256_setzero_ps();
    const float* q0 = q + i * d;
    for (int c = 0; c < body8; c += 8) {
      const __m256 k0 = Load8(ka + c), k1 = Load8(kb + c);
      for (int x = 0; x < 4; ++x) {
        const __m256 qv = _mm256_loadu_ps(q0 + x * d + c);
        a[x] = _mm256_fmadd_ps(qv, k0, a[x]);
        a[4 + x] = _mm256_fmadd_ps(qv, k1, a[4 + x]);
      }
    }
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    StoreFours(t, u, out_a + i * kMaxSlots, out_b + i * kMaxSlots);
  }
  for (; i < rg; ++i) {
    __m256 x = _mm256_setzero_ps(), y = _mm256_setzero_ps();
    for (int c = 0; c < body8; c += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i * d + c);
      x = _mm256_fmadd_ps(qv, Load8(ka + c), x);
      y = _mm256_fmadd_ps(qv, Load8(kb + c), y);
    }
    out_a[i * kMaxSlots] = Sum8(x), out_b[i * kMaxSlots] = Sum8(y);
  }
  DotPairTail(q, rg, ka, kb, d, body8, out_a, out_b);
}

// The largest of row[0, padded) (a multiple of 8) and whether any is NaN.
SPLASH_AVX2 inline float RowMaxAvx2(const float* row, int padded, bool* nan) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), bad = _mm256_setzero_ps();
  for (int j = 0; j < padded; j += 8) {
    const __m256 x = _mm256_loadu_ps(row + j);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, x);
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  *nan = _mm256_movemask_ps(bad) != 0;
  return _mm_cvtss_f32(h);
}

template <typename T>
SPLASH_AVX2 void AxpyGroupAvx2(const float* coeff, const uint8_t* take, int rg, const T* v,
                               int dv, float* acc) {
  const int body = dv & ~7;
  for (int c = 0; c < body; c += 8) {
    const __m256 x = Load8(v + c);
    for (int i = 0; i < rg; ++i) {
      if (!take[i]) continue;
      float* a = acc + i * dv + c;
      _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(coeff[i]), x, _mm256_loadu_ps(a)));
    }
  }
  for (int c = body; c < dv; ++c) {
    const float x = ToF32(v[c]);
    for (int i = 0; i < rg; ++i) if (take[i]) acc[i * dv + c] += coeff[i] * x;
  }
}

// acc[i] += coeff[i][j] * v[slots[t]] over the listed slots, for `kNi` vectors at a time: each
// 8-wide column of the accumulators stays in registers across the block (one load and one store
// of it per block, not per key). coeff [kNi][kMaxSlots]; every listed slot is seen by every
// vector (a probability of 0 never meets a value here).
template <typename T, int kNi>
SPLASH_AVX2 void AxpyBlockAvx2(const float* coeff, const int* slots, int nslots, const T* v,
                               int64_t stride, int dv, float* acc, const Ahead& ahead) {
  const int body = dv & ~15, body8 = dv & ~7;
  for (int c = 0; c < body; c += 16) {  // two columns at once: 2 * kNi independent FMA chains
    ahead.Share(c / 16, body / 16);
    __m256 a[kNi], b[kNi];
    for (int i = 0; i < kNi; ++i) {
      a[i] = _mm256_loadu_ps(acc + i * dv + c);
      b[i] = _mm256_loadu_ps(acc + i * dv + c + 8);
    }
    for (int t = 0; t < nslots; ++t) {
      const T* row = v + slots[t] * stride + c;
      const __m256 x = Load8(row), y = Load8(row + 8);
      for (int i = 0; i < kNi; ++i) {
        const __m256 p = _mm256_broadcast_ss(coeff + i * kMaxSlots + slots[t]);
        a[i] = _mm256_fmadd_ps(p, x, a[i]);
        b[i] = _mm256_fmadd_ps(p, y, b[i]);
      }
    }
    for (int i = 0; i < kNi; ++i) {
      _mm256_storeu_ps(acc + i * dv + c, a[i]);
      _mm256_storeu_ps(acc + i * dv + c + 8, b[i]);
    }
  }
  for (int c = body; c < body8; c += 8) {
    __m256 a[kNi];
    for (int i = 0; i < kNi; ++i) a[i] = _mm256_loadu_ps(acc + i * dv + c);
    for (int t = 0; t < nslots; ++t) {
      const __m256 x = Load8(v + slots[t] * stride + c);
      for (int i = 0; i < kNi; ++i)
        a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(coeff + i * kMaxSlots + slots[t]), x, a[i]);
    }
    for (int i = 0; i < kNi; ++i) _mm256_storeu_ps(acc + i * dv + c, a[i]);
  }
  for (int c = body8; c < dv; ++c)
    for (int t = 0; t < nslots; ++t) {
      const float x = ToF32(v[slots[t] * stride + c]);
      for (int i = 0; i < kNi; ++i) acc[i * dv + c] += coeff[i * kMaxSlots + slots[t]] * x;
    }
}

// AxpyBlockAvx2 over `rg` vectors, four at a time (the first four's passes read `ahead`; with
// no body of 16 columns it is read at once).
template <typename T>
SPLASH_AVX2 void AxpyBlockGroupAvx2(const float* coeff, const int* slots, int nslots, const T* v,
                                    int64_t stride, int rg, int dv, float* acc, const Ahead& ahead) {
  if (dv < 16) ahead.Share(0, 1);
  int i = 0;
  for (; i + 4 <= rg; i += 4)
    AxpyBlockAvx2<T, 4>(coeff + i * kMaxSlots, slots, nslots, v, stride, dv, acc + i * dv,
                        i ? Ahead() : ahead);
  const float* c = coeff + i * kMaxSlots;
  float* a = acc + i * dv;
  const Ahead& rest = i ? Ahead() : ahead;
  switch (rg - i) {
    case 3: AxpyBlockAvx2<T, 3>(c, slots, nslots, v, stride, dv, a, rest); break;
    case 2: AxpyBlockAvx2<T, 2>(c, slots, nslots, v, stride, dv, a, rest); break;
    case 1: AxpyBlockAvx2<T, 1>(c, slots, nslots, v, stride, dv, a, rest); break;
    default: break;
  }
}

#endif

// The SIMD levels of the kernel's code, lowest first: a kernel is built for each and the
// highest the CPU has (and the caller allows) runs.
enum Simd : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

inline int CpuSimd() {
#if SPLASH_X86
  static const int level = [] {
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
          __builtin_cpu_supports("f16c")))
      return kPortable;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
               ? kAvx512 : kAvx2;
  }();
  return level;
#else
  return kPortable;
#endif
}

#if SPLASH_X86
// ---- AVX-512: sixteen lanes, for the two loops that carry the arithmetic (the two-key dot
// and the value block); the rest of the item runs its AVX2 code ----
SPLASH_AVX512 inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
SPLASH_AVX512 inline __m512 Load16(const Bf16* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
SPLASH_AVX512 inline __m512 Load16(const F16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
SPLASH_AVX512 inline __m512 Load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
SPLASH_AVX512 inline __m512 Load16(const E5m2* p) {  // e5m2 is the top byte of a float16
  __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
}
SPLASH_AVX512 inline __m512 Load16(const E4m3* p) {  // as Load8's: a float16 of bias 15, x 2^8
  __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m256i mag = _mm256_and_si256(b, _mm256_set1_epi16(0x7f));
  __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                              _mm256_slli_epi16(mag, 7));
  __m256i nan = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7f));
  h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7e00)));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}

// The 256-bit sum of a 512-bit register's halves.
SPLASH_AVX512 inline __m256 Halves(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
}

// DotPairAvx2 sixteen lanes wide (a tail of d % 16 element by element).
template <typename T>
SPLASH_AVX512 void DotPairAvx512(const float* q, int rg, const T* ka, const T* kb, int d,
                                 float* out_a, float* out_b) {
  const int body = d & ~15;
  int i = 0;
  for (; i + 4 <= rg; i += 4) {
    __m512 a[8];
    for (int x = 0; x < 8; ++x) a[x] = _mm512_setzero_ps();
    const float* q0 = q + i * d;
    for (int c = 0; c < body; c += 16) {
      const __m512 k0 = Load16(ka + c), k1 = Load16(kb + c);
      for (int x = 0; x < 4; ++x) {
        const __m512 qv = _mm512_loadu_ps(q0 + x * d + c);
        a[x] = _mm512_fmadd_ps(qv, k0, a[x]);
        a[4 + x] = _mm512_fmadd_ps(qv, k1, a[4 + x]);
      }
    }
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(Halves(a[0]), Halves(a[1])),
                                    _mm256_hadd_ps(Halves(a[2]), Halves(a[3])));
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(Halves(a[4]), Halves(a[5])),
                                    _mm256_hadd_ps(Halves(a[6]), Halves(a[7])));
    StoreFours(t, u, out_a + i * kMaxSlots, out_b + i * kMaxSlots);
  }
  for (; i < rg; ++i) {
    __m512 x = _mm512_setzero_ps(), y = _mm512_setzero_ps();
    for (int c = 0; c < body; c += 16) {
      const __m512 qv = _mm512_loadu_ps(q + i * d + c);
      x = _mm512_fmadd_ps(qv, Load16(ka + c), x);
      y = _mm512_fmadd_ps(qv, Load16(kb + c), y);
    }
    out_a[i * kMaxSlots] = _mm512_reduce_add_ps(x), out_b[i * kMaxSlots] = _mm512_reduce_add_ps(y);
  }
  DotPairTail(q, rg, ka, kb, d, body, out_a, out_b);
}

// AxpyBlockAvx2 sixteen lanes wide: 32 columns a pass (2 * kNi FMA chains), then 16, then the
// tail element by element.
template <typename T, int kNi>
SPLASH_AVX512 void AxpyBlockAvx512(const float* coeff, const int* slots, int nslots, const T* v,
                                   int64_t stride, int dv, float* acc, const Ahead& ahead) {
  const int body = dv & ~31, body16 = dv & ~15;
  for (int c = 0; c < body; c += 32) {
    ahead.Share(c / 32, body / 32);
    __m512 a[kNi], b[kNi];
    for (int i = 0; i < kNi; ++i) {
      a[i] = _mm512_loadu_ps(acc + i * dv + c);
      b[i] = _mm512_loadu_ps(acc + i * dv + c + 16);
    }
    for (int t = 0; t < nslots; ++t) {
      const T* row = v + slots[t] * stride + c;
      const __m512 x = Load16(row), y = Load16(row + 16);
      for (int i = 0; i < kNi; ++i) {
        const __m512 p = _mm512_set1_ps(coeff[i * kMaxSlots + slots[t]]);
        a[i] = _mm512_fmadd_ps(p, x, a[i]);
        b[i] = _mm512_fmadd_ps(p, y, b[i]);
      }
    }
    for (int i = 0; i < kNi; ++i) {
      _mm512_storeu_ps(acc + i * dv + c, a[i]);
      _mm512_storeu_ps(acc + i * dv + c + 16, b[i]);
    }
  }
  if (body == 0) ahead.Share(0, 1);
  for (int c = body; c < body16; c += 16) {
    __m512 a[kNi];
    for (int i = 0; i < kNi; ++i) a[i] = _mm512_loadu_ps(acc + i * dv + c);
    for (int t = 0; t < nslots; ++t) {
      const __m512 x = Load16(v + slots[t] * stride + c);
      for (int i = 0; i < kNi; ++i)
        a[i] = _mm512_fmadd_ps(_mm512_set1_ps(coeff[i * kMaxSlots + slots[t]]), x, a[i]);
    }
    for (int i = 0; i < kNi; ++i) _mm512_storeu_ps(acc + i * dv + c, a[i]);
  }
  for (int c = body16; c < dv; ++c)
    for (int t = 0; t < nslots; ++t) {
      const float x = ToF32(v[slots[t] * stride + c]);
      for (int i = 0; i < kNi; ++i) acc[i * dv + c] += coeff[i * kMaxSlots + slots[t]] * x;
    }
}

// AxpyBlockAvx512 over `rg` vectors, four at a time (the first four's passes read `ahead`).
template <typename T>
SPLASH_AVX512 void AxpyBlockGroupAvx512(const float* coeff, const int* slots, int nslots,
                                        const T* v, int64_t stride, int rg, int dv, float* acc,
                                        const Ahead& ahead) {
  int i = 0;
  for (; i + 4 <= rg; i += 4)
    AxpyBlockAvx512<T, 4>(coeff + i * kMaxSlots, slots, nslots, v, stride, dv, acc + i * dv,
                          i ? Ahead() : ahead);
  const float* c = coeff + i * kMaxSlots;
  float* a = acc + i * dv;
  const Ahead& rest = i ? Ahead() : ahead;
  switch (rg - i) {
    case 3: AxpyBlockAvx512<T, 3>(c, slots, nslots, v, stride, dv, a, rest); break;
    case 2: AxpyBlockAvx512<T, 2>(c, slots, nslots, v, stride, dv, a, rest); break;
    case 1: AxpyBlockAvx512<T, 1>(c, slots, nslots, v, stride, dv, a, rest); break;
    default: break;
  }
}
#endif

// One block of keys as the kernel reads it: `slots` keys from `key` (slot stride `key_stride`
// elements), their values likewise, per-key scales (or null) and the visibility of each
// (query vector, slot): visible[i * kMaxSlots + j].
template <typename T>
struct Block {
  const T* key;
  const T* value;
  const float* key_scale;
  const float* value_scale;
  int64_t key_stride, value_stride, scale_stride;
  int slots;
  int first_pos;             // the position of slot 0 when `positions` is null
  const int32_t* positions;  // each slot's position, or null: first_pos + slot
  int Position(int j) const { return positions ? positions[j] : first_pos + j; }
};

// What stays fixed over an item: its query vectors (pre-scaled, f32) and sizes.
struct ItemShape {
  const float* q;  // [RG, D]
  int rg, d, dv;
  float soft_cap;  // 0: none
  const float* slopes;   // [RG] ALiBi slopes (-slope * |q_pos - kv_pos| added), or null
  const int32_t* q_pos;  // [RG] each vector's row position (read with slopes)
};

// The online softmax of an item: running max, denominator and weighted values per vector.
struct State {
  float m[kMaxRG], l[kMaxRG];
  std::vector<float> acc;  // [RG, Dv]
  void Reset(int rg, int dv) {
    std::fill(m, m + rg, kNegInf);
    std::fill(l, l + rg, 0.0f);
    acc.assign(static_cast<size_t>(rg) * dv, 0.0f);
  }
};

// row[j] = exp(row[j] - m) for j < n (0 where row[j] is -inf: an invisible key); returns their
// sum. `m` is finite or +inf here (a NaN row takes the scalar path).
inline float ExpRowPortable(float* row, int n, float m) {
  float sum = 0.0f;
  for (int j = 0; j < n; ++j) {
    row[j] = row[j] == kNegInf ? 0.0f : std::exp(row[j] - m);
    sum += row[j];
  }
  return sum;
}

#if SPLASH_X86
// exp of eight lanes (Cephes' expf: a degree-5 polynomial after 2^n; within 2 ulp).
SPLASH_AVX2 inline __m256 Exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)),
                    _mm256_set1_ps(88.3762626647949f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                             _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// ExpRowPortable eight lanes at a time; `row` holds -inf from n up to the next multiple of 8.
SPLASH_AVX2 inline float ExpRowAvx2(float* row, int n, float m) {
  __m256 sum = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m), none = _mm256_set1_ps(kNegInf);
  for (int j = 0; j < n; j += 8) {
    const __m256 x = _mm256_loadu_ps(row + j);
    const __m256 p = _mm256_and_ps(Exp8(_mm256_sub_ps(x, mv)), _mm256_cmp_ps(x, none, _CMP_NEQ_OQ));
    _mm256_storeu_ps(row + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  return Sum8(sum);
}
#endif

// s[i][j] *= scale[j * stride] for every vector i and slot j < n (every slot seen).
inline void ScaleSlots(const float* scale, int64_t stride, int rg, int n, float* s) {
  float x[kMaxSlots];
  for (int j = 0; j < n; ++j) x[j] = scale[j * stride];
  for (int i = 0; i < rg; ++i)
    for (int j = 0; j < n; ++j) s[i * kMaxSlots + j] *= x[j];
}

// q[i] . k for the keys at ka and kb (kb null: ka alone) into out_a[i * kMaxSlots] and
// out_b[i * kMaxSlots].
template <typename T, int kSimd>
void DotKeys(const ItemShape& it, const T* ka, const T* kb, float* out_a, float* out_b) {
#if SPLASH_X86
  if constexpr (kSimd >= kAvx512) {
    if (kb) return DotPairAvx512(it.q, it.rg, ka, kb, it.d, out_a, out_b);
  } else if constexpr (kSimd >= kAvx2) {
    if (kb) return DotPairAvx2(it.q, it.rg, ka, kb, it.d, out_a, out_b);
  }
#endif
  float dots[kMaxRG];
  for (int x = 0; x < (kb ? 2 : 1); ++x) {
#if SPLASH_X86
    if constexpr (kSimd >= kAvx2) DotGroupAvx2(it.q, it.rg, x ? kb : ka, it.d, dots);
    else DotGroupPortable(it.q, it.rg, x ? kb : ka, it.d, dots);
#else
    DotGroupPortable(it.q, it.rg, x ? kb : ka, it.d, dots);
#endif
    for (int i = 0; i < it.rg; ++i) (x ? out_b : out_a)[i * kMaxSlots] = dots[i];
  }
}

// The slots some vector sees into `slots` (every slot where `visible` is null: every vector
// sees every key); returns how many.
inline int SeenSlots(int rg, int n, const uint8_t* visible, int* slots) {
  int count = 0;
  for (int j = 0; j < n; ++j) {
    bool any = !visible;
    for (int i = 0; i < rg && !any; ++i) any = visible[i * kMaxSlots + j];
    if (any) slots[count++] = j;
  }
  return count;
}

// The block's logits into s [RG, kMaxSlots] (-inf where a vector does not see a key, and from
// the block's end to a multiple of 8); `slots` [nslots] the keys some vector sees (SeenSlots).
// `visible` null: every vector sees every key. The next block's scales (or none) and keys
// (`keys_ahead`, a share each pass) are prefetched while this one's are read.
template <typename T, int kSimd>
void Logits(const ItemShape& it, const Block<T>& b, const uint8_t* visible, const Block<T>* next,
            const Ahead& keys_ahead, const int* slots, int nslots, float* s) {
  const int rg = it.rg, n = b.slots, padded = (n + 7) & ~7;
  if (next && next->key_scale) {  // the next block's per-key scales (quantized keys, values)
    Prefetch(next->key_scale, next->slots * next->scale_stride * sizeof(float));
    Prefetch(next->value_scale, next->slots * next->scale_stride * sizeof(float));
  }
  for (int i = 0; i < rg; ++i)
    std::fill(s + i * kMaxSlots + (visible ? 0 : n), s + i * kMaxSlots + padded, kNegInf);
  const int passes = (nslots + 1) / 2;
  if (!passes) keys_ahead.Share(0, 1);
  for (int t = 0; t < nslots; t += 2) {  // two keys a pass
    keys_ahead.Share(t / 2, passes);
    const int ja = slots[t], jb = t + 1 < nslots ? slots[t + 1] : -1;
    DotKeys<T, kSimd>(it, b.key + ja * b.key_stride, jb < 0 ? nullptr : b.key + jb * b.key_stride,
                      s + ja, jb < 0 ? nullptr : s + jb);
  }
  if (!visible && b.key_scale) ScaleSlots(b.key_scale, b.scale_stride, rg, n, s);
  if (!it.slopes && it.soft_cap <= 0 && !visible) return;
  for (int i = 0; i < rg; ++i)
    for (int t = 0; t < nslots; ++t) {
      const int j = slots[t];
      float& x = s[i * kMaxSlots + j];
      if (visible && b.key_scale) x *= b.key_scale[j * b.scale_stride];
      if (it.slopes) x -= it.slopes[i] * std::fabs(static_cast<float>(it.q_pos[i] - b.Position(j)));
      if (it.soft_cap > 0) x = it.soft_cap * std::tanh(x / it.soft_cap);
      if (visible && !visible[i * kMaxSlots + j]) x = kNegInf;
    }
}

// A row's largest logit over [0, n) (padded: -inf to a multiple of 8) and whether one is NaN.
template <int kSimd>
float RowMax(const float* row, int n, bool* nan) {
#if SPLASH_X86
  if constexpr (kSimd >= kAvx2) return RowMaxAvx2(row, (n + 7) & ~7, nan);
#endif
  float mb = kNegInf;
  *nan = false;
  for (int j = 0; j < n; ++j) {
    *nan |= std::isnan(row[j]);
    mb = row[j] > mb ? row[j] : mb;
  }
  return mb;
}

// Each vector's block max, its running state rescaled once, its logits in s replaced by their
// exponentials; coeff[i] = 0 for a vector that sees nothing here (else 1).
template <int kSimd>
void Softmax(const ItemShape& it, int n, float* s, State& st, float* coeff) {
  const int padded = (n + 7) & ~7;
  for (int i = 0; i < it.rg; ++i) {
    float* row = s + i * kMaxSlots;
    bool nan;
    float mb = RowMax<kSimd>(row, n, &nan);
    if (nan) mb = NAN;  // a NaN logit the vector sees: its result is NaN
    else if (mb == kNegInf) { coeff[i] = 0; continue; }
    const float m_new = std::isnan(st.m[i]) || nan ? NAN : std::max(st.m[i], mb);
    const float alpha = st.m[i] == kNegInf ? 0.0f : std::exp(st.m[i] - m_new);
    if (alpha != 1.0f) {
      st.l[i] *= alpha;
      float* a = st.acc.data() + static_cast<size_t>(i) * it.dv;
      for (int c = 0; c < it.dv; ++c) a[c] *= alpha;
    }
    st.m[i] = m_new;
#if SPLASH_X86
    if constexpr (kSimd >= kAvx2) st.l[i] += std::isnan(m_new) ? ExpRowPortable(row, n, m_new)
                                                     : ExpRowAvx2(row, padded, m_new);
    else st.l[i] += ExpRowPortable(row, n, m_new);
#else
    st.l[i] += ExpRowPortable(row, n, m_new);
#endif
    coeff[i] = 1;
  }
}

// The values: where every key some vector sees is seen by every vector that has a key in the
// block (a decode row, a run inside its bounds; always where `visible` is null), all at once
// per column; else key by key, each vector taking only the keys it sees (0 * a NaN it does
// not see would spread it).
template <typename T, int kSimd>
void Values(const ItemShape& it, const Block<T>& b, const uint8_t* visible, const int* slots,
            int nslots, const float* coeff, const Ahead& values_ahead, float* s, State& st) {
  const int rg = it.rg;
  bool whole = true;
  for (int t = 0; visible && t < nslots; ++t)
    for (int i = 0; i < rg; ++i) whole &= coeff[i] == 0 || visible[i * kMaxSlots + slots[t]];
  if (b.value_scale && !visible) ScaleSlots(b.value_scale, b.scale_stride, rg, b.slots, s);
  else if (b.value_scale)
    for (int i = 0; i < rg; ++i)
      for (int t = 0; t < nslots; ++t) s[i * kMaxSlots + slots[t]] *= b.value_scale[slots[t] * b.scale_stride];
#if SPLASH_X86
  if constexpr (kSimd >= kAvx2) {
    if (whole) {
      for (int i = 0; i < rg; ++i)  // a vector with nothing here adds zeros
        if (coeff[i] == 0) for (int t = 0; t < nslots; ++t) s[i * kMaxSlots + slots[t]] = 0.0f;
      if constexpr (kSimd >= kAvx512)
        AxpyBlockGroupAvx512(s, slots, nslots, b.value, b.value_stride, rg, it.dv,
                             st.acc.data(), values_ahead);
      else
        AxpyBlockGroupAvx2(s, slots, nslots, b.value, b.value_stride, rg, it.dv, st.acc.data(),
                           values_ahead);
      return;
    }
  }
#endif
  values_ahead.Share(0, 1);
  float c[kMaxRG];
  uint8_t take[kMaxRG];
  for (int t = 0; t < nslots; ++t) {
    const int j = slots[t];
    for (int i = 0; i < rg; ++i) {
      take[i] = coeff[i] != 0 && (!visible || visible[i * kMaxSlots + j]);
      c[i] = s[i * kMaxSlots + j];
    }
    const T* v = b.value + j * b.value_stride;
#if SPLASH_X86
    if constexpr (kSimd >= kAvx2) AxpyGroupAvx2(c, take, rg, v, it.dv, st.acc.data());
    else AxpyGroupPortable(c, take, rg, v, it.dv, st.acc.data());
#else
    AxpyGroupPortable(c, take, rg, v, it.dv, st.acc.data());
#endif
  }
}

// Folds one block into `st` (logits, softmax, values), prefetching the `next` one meanwhile.
// Logits are held per vector ([RG, kMaxSlots]), so each vector's max and exponentials run over
// its slots in lanes. `visible` null: every vector sees every key of the block.
template <typename T, int kSimd>
void FoldBlock(const ItemShape& it, const Block<T>& b, const uint8_t* visible, State& st,
               const Block<T>* next) {
  alignas(32) float s[kMaxRG * kMaxSlots];  // [RG, slots]
  int slots[kMaxSlots];
  float coeff[kMaxRG];
  const int nslots = SeenSlots(it.rg, b.slots, visible, slots);
  const int64_t key_row = next ? next->key_stride * sizeof(T) : 0;  // whole rows: every
  const int64_t value_row = next ? next->value_stride * sizeof(T) : 0;  // head's share of them
  const Ahead keys = next ? Ahead(next->key, key_row, next->slots, key_row) : Ahead();
  const Ahead values = next ? Ahead(next->value, value_row, next->slots, value_row) : Ahead();
  Logits<T, kSimd>(it, b, visible, next, keys, slots, nslots, s);
  Softmax<kSimd>(it, b.slots, s, st, coeff);
  Values<T, kSimd>(it, b, visible, slots, nslots, coeff, values, s, st);
}

// The item's results with its heads' sinks (log-sum-exp per vector, -inf: none): out [RG, Dv]
// at `out` (vector i at out + out_row(i)), lse at lse_at(i).
template <typename OutAt, typename LseAt>
void Finish(const State& st, int rg, int dv, const float* sinks, OutAt out_at, LseAt lse_at) {
  for (int i = 0; i < rg; ++i) {
    const float m = st.m[i], sink = sinks[i];
    const float top = std::isnan(m) ? m : std::max(m, sink);
    float* out = out_at(i);
    if (top == kNegInf) {
      std::fill(out, out + dv, 0.0f);
      *lse_at(i) = kNegInf;
      continue;
    }
    const float keys = m == kNegInf ? 0.0f : st.l[i] * std::exp(m - top);
    const float total = keys + (sink == kNegInf ? 0.0f : std::exp(sink - top));
    const float w = m == kNegInf ? 0.0f : std::exp(m - top) / total;
    const float* a = st.acc.data() + static_cast<size_t>(i) * dv;
    for (int c = 0; c < dv; ++c) out[c] = a[c] * w;
    *lse_at(i) = top + std::log(total);
  }
}

// Runs run(item) for items [0, n) on `threads` threads (the caller's among them), largest
// first by `cost`; returns when every item is done.
template <typename Run>
void RunItems(const std::vector<int64_t>& cost, int threads, Run run) {
  const int n = static_cast<int>(cost.size());
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return cost[a] > cost[b]; });
  std::atomic<int> next{0};
  auto work = [&]() { for (int i; (i = next.fetch_add(1)) < n;) run(order[i]); };
  const int extra = std::max(0, std::min(threads, n) - 1);
  std::vector<std::thread> pool;
  pool.reserve(extra);
  for (int t = 0; t < extra; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

}  // namespace splash_native
