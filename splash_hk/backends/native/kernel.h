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
#else
#define SPLASH_X86 0
#endif

namespace splash_native {

constexpr int kMaxSlots = 64;   // keys of a block (pages larger than this are read in parts)
constexpr int kMaxRows = 8;
#ifndef SPLASH_PREFETCH_BLOCKS
#define SPLASH_PREFETCH_BLOCKS 1
#endif
constexpr int kPrefetchBlocks = SPLASH_PREFETCH_BLOCKS;  // how far ahead blocks are prefetched     // query rows of one item
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
                               int64_t stride, int dv, float* acc) {
  const int body = dv & ~15, body8 = dv & ~7;
  for (int c = 0; c < body; c += 16) {  // two columns at once: 2 * kNi independent FMA chains
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

// AxpyBlockAvx2 over `rg` vectors, four at a time.
template <typename T>
SPLASH_AVX2 void AxpyBlockGroupAvx2(const float* coeff, const int* slots, int nslots, const T* v,
                                    int64_t stride, int rg, int dv, float* acc) {
  int i = 0;
  for (; i + 4 <= rg; i += 4)
    AxpyBlockAvx2<T, 4>(coeff + i * kMaxSlots, slots, nslots, v, stride, dv, acc + i * dv);
  const float* c = coeff + i * kMaxSlots;
  float* a = acc + i * dv;
  switch (rg - i) {
    case 3: AxpyBlockAvx2<T, 3>(c, slots, nslots, v, stride, dv, a); break;
    case 2: AxpyBlockAvx2<T, 2>(c, slots, nslots, v, stride, dv, a); break;
    case 1: AxpyBlockAvx2<T, 1>(c, slots, nslots, v, stride, dv, a); break;
    default: break;
  }
}

inline bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}
#else
inline bool HasAvx2() { return false; }
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

#ifndef SPLASH_PREFETCH_LOCALITY
#define SPLASH_PREFETCH_LOCALITY 2  // into L2 (prefetcht1): measured best here
#endif
// Prefetches `bytes` from `p` into the cache (reads ahead of the block being folded).
inline void Prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, SPLASH_PREFETCH_LOCALITY);
}

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

// The block's logits into s [RG, kMaxSlots] (-inf where a vector does not see a key; padded to
// a multiple of 8 with -inf), `any[j]`: some vector sees key j. The `next` block's keys,
// values and scales (or none) are prefetched a slot at a time while this one's are read.
template <typename T, bool kAvx2>
void Logits(const ItemShape& it, const Block<T>& b, const uint8_t* visible, const Block<T>* next,
            float* s, uint8_t* any) {
  const int rg = it.rg, n = b.slots, padded = (n + 7) & ~7;
  float dots[kMaxRG];
  if (next && next->key_scale) {  // the next block's per-key scales (quantized keys, values)
    Prefetch(next->key_scale, next->slots * next->scale_stride * sizeof(float));
    Prefetch(next->value_scale, next->slots * next->scale_stride * sizeof(float));
  }
  for (int j = 0; j < padded; ++j) {
    any[j] = 0;
    if (j < n) for (int i = 0; i < rg; ++i) any[j] |= visible[i * kMaxSlots + j];
    if (next && j < next->slots) {
      Prefetch(next->key + j * next->key_stride, it.d * sizeof(T));
      Prefetch(next->value + j * next->value_stride, it.dv * sizeof(T));
    }
    if (!any[j]) {
      for (int i = 0; i < rg; ++i) s[i * kMaxSlots + j] = kNegInf;
      continue;
    }
    const T* k = b.key + j * b.key_stride;
#if SPLASH_X86
    if constexpr (kAvx2) DotGroupAvx2(it.q, rg, k, it.d, dots);
    else DotGroupPortable(it.q, rg, k, it.d, dots);
#else
    DotGroupPortable(it.q, rg, k, it.d, dots);
#endif
    const float ks = b.key_scale ? b.key_scale[j * b.scale_stride] : 1.0f;
    for (int i = 0; i < rg; ++i) {
      float x = dots[i] * ks;
      if (it.slopes) x -= it.slopes[i] * std::fabs(static_cast<float>(it.q_pos[i] - b.Position(j)));
      if (it.soft_cap > 0) x = it.soft_cap * std::tanh(x / it.soft_cap);
      s[i * kMaxSlots + j] = visible[i * kMaxSlots + j] ? x : kNegInf;
    }
  }
}

// Each vector's block max, its running state rescaled once, its logits in s replaced by their
// exponentials; coeff[i] = 0 for a vector that sees nothing here (else 1).
template <bool kAvx2>
void Softmax(const ItemShape& it, int n, float* s, State& st, float* coeff) {
  const int padded = (n + 7) & ~7;
  for (int i = 0; i < it.rg; ++i) {
    float* row = s + i * kMaxSlots;
    float mb = kNegInf;
    bool nan = false;
    for (int j = 0; j < n; ++j) {
      nan |= std::isnan(row[j]);
      mb = row[j] > mb ? row[j] : mb;
    }
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
    if constexpr (kAvx2) st.l[i] += std::isnan(m_new) ? ExpRowPortable(row, n, m_new)
                                                     : ExpRowAvx2(row, padded, m_new);
    else st.l[i] += ExpRowPortable(row, n, m_new);
#else
    st.l[i] += ExpRowPortable(row, n, m_new);
#endif
    coeff[i] = 1;
  }
}

// The values: where every key some vector sees is seen by every vector that has a key in the
// block (a decode row, a run inside its bounds), all at once per column; else key by key, each
// vector taking only the keys it sees (0 * a NaN it does not see would spread it).
template <typename T, bool kAvx2>
void Values(const ItemShape& it, const Block<T>& b, const uint8_t* visible, const uint8_t* any,
            const float* coeff, float* s, State& st) {
  const int rg = it.rg;
  int slots[kMaxSlots], nslots = 0;
  bool whole = true;
  for (int j = 0; j < b.slots; ++j) {
    if (!any[j]) continue;
    slots[nslots++] = j;
    for (int i = 0; i < rg; ++i) whole &= coeff[i] == 0 || visible[i * kMaxSlots + j];
  }
  if (b.value_scale)
    for (int i = 0; i < rg; ++i)
      for (int t = 0; t < nslots; ++t) s[i * kMaxSlots + slots[t]] *= b.value_scale[slots[t] * b.scale_stride];
#if SPLASH_X86
  if constexpr (kAvx2) {
    if (whole) {
      for (int i = 0; i < rg; ++i)  // a vector with nothing here adds zeros
        if (coeff[i] == 0) for (int t = 0; t < nslots; ++t) s[i * kMaxSlots + slots[t]] = 0.0f;
      AxpyBlockGroupAvx2(s, slots, nslots, b.value, b.value_stride, rg, it.dv, st.acc.data());
      return;
    }
  }
#endif
  float c[kMaxRG];
  uint8_t take[kMaxRG];
  for (int t = 0; t < nslots; ++t) {
    const int j = slots[t];
    for (int i = 0; i < rg; ++i) {
      take[i] = coeff[i] != 0 && visible[i * kMaxSlots + j];
      c[i] = s[i * kMaxSlots + j];
    }
    const T* v = b.value + j * b.value_stride;
#if SPLASH_X86
    if constexpr (kAvx2) AxpyGroupAvx2(c, take, rg, v, it.dv, st.acc.data());
    else AxpyGroupPortable(c, take, rg, v, it.dv, st.acc.data());
#else
    AxpyGroupPortable(c, take, rg, v, it.dv, st.acc.data());
#endif
  }
}

// Folds one block into `st` (logits, softmax, values), prefetching the `next` one meanwhile.
// Logits are held per vector ([RG, kMaxSlots]), so each vector's max and exponentials run over
// its slots in lanes.
template <typename T, bool kAvx2>
void FoldBlock(const ItemShape& it, const Block<T>& b, const uint8_t* visible, State& st,
               const Block<T>* next) {
  alignas(32) float s[kMaxRG * kMaxSlots];  // [RG, slots]
  uint8_t any[kMaxSlots];
  float coeff[kMaxRG];
  Logits<T, kAvx2>(it, b, visible, next, s, any);
  Softmax<kAvx2>(it, b.slots, s, st, coeff);
  Values<T, kAvx2>(it, b, visible, any, coeff, s, st);
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
