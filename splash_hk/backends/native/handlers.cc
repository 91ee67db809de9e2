// The native decode kernel's XLA FFI handlers: `PagedDecode` over a paged pool's lists of pages,
// `CacheDecode` over a fixed cache's rows, and `PageBounds`, Quest's bound of every page of a
// step's sequences (`sparse.top_k_pages`). The Python side (splash_hk/backends/native.py)
// owns shapes and checks; these read the buffers as it lays them out and split the work into
// items (rows of one owner x one kv head) run on `threads` threads.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace sn = splash_native;

namespace {

// What both handlers share: queries [rows, Hq, D] (pre-scaled f32), keys/values and per-key
// scales (null: not quantized), sinks' log-sum-exp [Hq] and the outputs.
struct Common {
  const float* query;
  const void* key;
  const void* value;
  const float* key_scale;
  const float* value_scale;
  const float* sinks;
  const float* slopes;  // [Hq] ALiBi slopes, or null
  const int32_t* q_pos;  // [rows] each query row's position (read with slopes)
  float* out;
  float* lse;
  int hq, hkv, d, dv, threads;
  float soft_cap;
  int group() const { return hq / hkv; }
  int rows_per_item() const { return std::max(1, std::min(sn::kMaxRows, sn::kMaxRG / group())); }
};

// Rows that see nothing: output 0, log-sum-exp of their sinks alone.
void Clear(const Common& c, int64_t rows) {
  for (int64_t n = 0; n < rows; ++n)
    for (int h = 0; h < c.hq; ++h) {
      std::fill(c.out + (n * c.hq + h) * c.dv, c.out + (n * c.hq + h + 1) * c.dv, 0.0f);
      c.lse[n * c.hq + h] = c.sinks[h];
    }
}

// One kv head's share of an item: its query vectors (rows x group heads, pre-scaled), their
// sinks, ALiBi slopes and positions, and its online softmax.
struct Head {
  std::vector<float> q;  // [RG, D]
  float sinks[sn::kMaxRG], slopes[sn::kMaxRG];
  int32_t q_pos[sn::kMaxRG];
  sn::State st;

  Head(const Common& c, const int* rows, int nrows, int h) : q(static_cast<size_t>(nrows) * c.group() * c.d) {
    const int g = c.group();
    for (int r = 0; r < nrows; ++r)
      for (int i = 0; i < g; ++i) {
        slopes[r * g + i] = c.slopes ? c.slopes[h * g + i] : 0.0f;
        q_pos[r * g + i] = c.q_pos[rows[r]];
        const float* src = c.query + (static_cast<int64_t>(rows[r]) * c.hq + h * g + i) * c.d;
        std::copy(src, src + c.d, q.data() + static_cast<size_t>(r * g + i) * c.d);
        sinks[r * g + i] = c.sinks[h * g + i];
      }
    st.Reset(nrows * g, c.dv);
  }
};

// What a block's visibility is: no vector sees a key of it, some see some (the `visible`
// array says which), every vector sees every key (the array is not filled).
enum Seen { kNone = 0, kSome = 1, kAll = 2 };

// Share x of n of a block's rows (its slots cut in n runs), for the n heads of an item to
// prefetch a part each.
template <typename T>
sn::Block<T> Share(sn::Block<T> b, int x, int n) {
  const int from = b.slots * x / n, to = b.slots * (x + 1) / n;
  b.key += from * b.key_stride, b.value += from * b.value_stride;
  if (b.key_scale) b.key_scale += from * b.scale_stride, b.value_scale += from * b.scale_stride;
  b.slots = to - from;
  return b;
}

// One item: rows `rows[0..nrows)` (flat query rows) x kv heads [h0, h0 + nh) over `nblocks`
// blocks, block e of head h given by desc(e, h), its visibility (the same for every head) by
// vis(e, block, visible) -> Seen. The heads of a block are read one after the other (a fixed
// cache's token rows hold every head's keys: read once, while in cache); the heads share the
// prefetch of the next block's rows, whole rows (every head's share of a token row at once),
// a run of rows each.
template <typename T, int kSimd, typename Desc, typename Vis>
void Item(const Common& c, const int* rows, int nrows, int h0, int nh, int nblocks, Desc desc,
          Vis vis) {
  const int g = c.group(), rg = nrows * g;
  std::vector<Head> heads;
  heads.reserve(nh);
  for (int h = h0; h < h0 + nh; ++h) heads.emplace_back(c, rows, nrows, h);
  alignas(64) uint8_t visible[sn::kMaxRG * sn::kMaxSlots];
  for (int e = 0; e < nblocks; ++e) {
    const int seen = vis(e, desc(e, h0), visible);
    if (seen == kNone) continue;
    const int ahead = e + sn::kPrefetchBlocks;  // the block read ahead (prefetched) meanwhile
    const sn::Block<T> span = desc(std::min(ahead, nblocks - 1), h0);  // every head's rows
    for (int x = 0; x < nh; ++x) {
      Head& hd = heads[x];
      const sn::ItemShape shape{hd.q.data(), rg, c.d, c.dv, c.soft_cap,
                                c.slopes ? hd.slopes : nullptr, hd.q_pos};
      const sn::Block<T> b = desc(e, h0 + x);
      const sn::Block<T> next = Share(span, x, nh);
      sn::FoldBlock<T, kSimd>(shape, b, seen == kAll ? nullptr : visible, hd.st,
                              ahead < nblocks ? &next : nullptr);
    }
  }
  for (int x = 0; x < nh; ++x) {
    const int64_t h = h0 + x;
    auto out_at = [&](int i) {
      return c.out + (static_cast<int64_t>(rows[i / g]) * c.hq + h * g + i % g) * c.dv;
    };
    auto lse_at = [&](int i) {
      return c.lse + static_cast<int64_t>(rows[i / g]) * c.hq + h * g + i % g;
    };
    sn::Finish(heads[x].st, rg, c.dv, heads[x].sinks, out_at, lse_at);
  }
}

// ---- the paged pool: key [P, Hkv, page, D], lists [O, Hl, K] ----
// A batch's draft trees (RaggedBatch.tree), per row: its sequence's first new slot and first
// row, its depth-first walk's entry and exit, its position by depth. Null `enter`: chains.
struct TreeRows {
  const int32_t *first_new, *first_row, *enter, *leave, *at;
  int rows;
  int Row(int row, int slot) const {  // the row that wrote a new slot of `row`'s sequence
    return std::min(std::max(first_row[row] + slot - first_new[row], 0), rows - 1);
  }
  // Whether `row` may see `slot` of its sequence as a tree says (a new key: its own or an
  // ancestor's; cached keys: the bounds decide).
  bool Sees(int row, int slot) const {
    if (!enter || slot < first_new[row]) return true;
    const int a = Row(row, slot);
    return enter[a] <= enter[row] && enter[row] < leave[a];
  }
  int Position(int row, int slot) const {
    return !enter || slot < first_new[row] ? slot : at[Row(row, slot)];
  }
};

struct Lists {
  const int32_t *blocks, *first_key, *count, *order, *offset, *rows, *lo, *hi;
  int owners, list_heads, entries, page;
  TreeRows tree;
};

template <typename T, int kSimd>
void Paged(const Common& c, const Lists& l) {
  const int per = c.rows_per_item(), parts = (l.page + sn::kMaxSlots - 1) / sn::kMaxSlots;
  struct Work { int owner, head, first, nrows; };
  std::vector<Work> work;
  std::vector<int64_t> cost;
  for (int o = 0; o < l.owners; ++o)
    for (int h = 0; h < c.hkv; ++h) {
      const int n = l.count[o * l.list_heads + (l.list_heads == 1 ? 0 : h)];
      for (int r = 0; r < l.rows[o] && n > 0; r += per) {
        work.push_back({o, h, r, std::min(per, l.rows[o] - r)});
        cost.push_back(static_cast<int64_t>(n) * (work.back().nrows + 3));
      }
    }
  const T* key = static_cast<const T*>(c.key);
  const T* value = static_cast<const T*>(c.value);
  sn::RunItems(cost, c.threads, [&](int w) {
    const Work& it = work[w];
    const int hl = l.list_heads == 1 ? 0 : it.head;
    const int64_t at = (static_cast<int64_t>(it.owner) * l.list_heads + hl) * l.entries;
    const int* rows = l.order + l.offset[it.owner] + it.first;
    int lo = INT32_MAX, hi = INT32_MIN;  // the item's key range, to skip pages outside it
    for (int r = 0; r < it.nrows; ++r) lo = std::min(lo, l.lo[rows[r]]), hi = std::max(hi, l.hi[rows[r]]);
    int32_t by_depth[2][sn::kMaxSlots];  // a tree's key positions: this block's and the next's
    auto desc = [&](int e, int head) {
      const int part = e % parts;
      const int64_t slot0 = ((static_cast<int64_t>(l.blocks[at + e / parts]) * c.hkv + head) *
                             l.page) + part * sn::kMaxSlots;
      const int first = l.first_key[at + e / parts] + part * sn::kMaxSlots;
      const int slots = std::min(sn::kMaxSlots, l.page - part * sn::kMaxSlots);
      int32_t* positions = nullptr;  // ALiBi over a tree's new keys: positions by depth
      if (l.tree.enter && c.slopes && first + slots > l.tree.first_new[rows[0]]) {
        positions = by_depth[e & 1];
        for (int j = 0; j < slots; ++j) positions[j] = l.tree.Position(rows[0], first + j);
      }
      return sn::Block<T>{key + slot0 * c.d, value + slot0 * c.dv,
                          c.key_scale ? c.key_scale + slot0 : nullptr,
                          c.value_scale ? c.value_scale + slot0 : nullptr, c.d, c.dv, 1,
                          slots, first, positions};
    };
    auto vis = [&](int e, const sn::Block<T>& b, uint8_t* visible) {
      const int first = l.first_key[at + e / parts] + (e % parts) * sn::kMaxSlots;
      const int last = first + b.slots - 1;
      if (first > hi || last < lo) return kNone;
      bool all = true;
      for (int r = 0; r < it.nrows; ++r)
        all &= first >= l.lo[rows[r]] && last <= l.hi[rows[r]] &&
               (!l.tree.enter || last < l.tree.first_new[rows[r]]);
      if (all) return kAll;
      const int g = c.group();
      for (int r = 0; r < it.nrows; ++r) {
        const int rlo = l.lo[rows[r]], rhi = l.hi[rows[r]];
        for (int j = 0; j < b.slots; ++j) {
          const int slot = first + j;
          const uint8_t v = slot >= rlo && slot <= rhi && l.tree.Sees(rows[r], slot);
          for (int i = 0; i < g; ++i) visible[(r * g + i) * sn::kMaxSlots + j] = v;
        }
      }
      return kSome;
    };
    Item<T, kSimd>(c, rows, it.nrows, it.head, 1, l.count[at / l.entries] * parts, desc, vis);
  });
}

// ---- the fixed cache: key [B, S, Hkv, D], positions and segments per row and slot ----
struct Rows {
  const int32_t *q_pos, *q_seg, *kv_pos, *kv_seg, *extent;
  int batch, queries, slots, causal, left, right, chunk;  // left/right < 0: no window
};

inline int FloorDiv(int a, int b) { return a >= 0 ? a / b : -((b - 1 - a) / b); }

inline bool Sees(const Rows& r, int qp, int kp) {
  if (r.causal && kp > qp) return false;
  if (r.left >= 0 && (kp < qp - r.left || kp > qp + r.right)) return false;
  return !r.chunk || FloorDiv(qp, r.chunk) == FloorDiv(kp, r.chunk);
}

template <typename T, int kSimd>
void Cache(const Common& c, const Rows& r) {
  constexpr int kSlots = 32;  // keys of a block (every kv head's, read together)
  const int per = c.rows_per_item();
  struct Work { int b, head, first, nrows; };
  std::vector<Work> work;
  std::vector<int64_t> cost;
  for (int b = 0; b < r.batch; ++b)  // every kv head of a row in one item: its token rows
    for (int t = 0; t < r.queries; t += per) {  // hold them all, read once
      work.push_back({b, 0, t, std::min(per, r.queries - t)});
      cost.push_back(static_cast<int64_t>(r.extent[b]) * (work.back().nrows + 3));
    }
  const T* key = static_cast<const T*>(c.key);
  const T* value = static_cast<const T*>(c.value);
  sn::RunItems(cost, c.threads, [&](int w) {
    const Work& it = work[w];
    int rows[sn::kMaxRows];
    for (int i = 0; i < it.nrows; ++i) rows[i] = it.b * r.queries + it.first + i;
    const int extent = std::min(r.extent[it.b], r.slots);
    auto desc = [&](int e, int head) {
      const int64_t slot0 = (static_cast<int64_t>(it.b) * r.slots + e * kSlots) * c.hkv + head;
      return sn::Block<T>{key + slot0 * c.d, value + slot0 * c.dv,
                          c.key_scale ? c.key_scale + slot0 : nullptr,
                          c.value_scale ? c.value_scale + slot0 : nullptr,
                          static_cast<int64_t>(c.hkv) * c.d, static_cast<int64_t>(c.hkv) * c.dv,
                          c.hkv, std::min(kSlots, extent - e * kSlots), 0,
                          r.kv_pos + static_cast<int64_t>(it.b) * r.slots + e * kSlots};
    };
    auto vis = [&](int e, const sn::Block<T>& b, uint8_t* visible) {
      const int g = c.group();
      const int32_t* kp = r.kv_pos + static_cast<int64_t>(it.b) * r.slots + e * kSlots;
      const int32_t* ks = r.kv_seg + static_cast<int64_t>(it.b) * r.slots + e * kSlots;
      bool any = false, all = true;
      for (int i = 0; i < it.nrows; ++i) {
        const int qp = r.q_pos[rows[i]], qs = r.q_seg[rows[i]];
        for (int j = 0; j < b.slots; ++j) {
          const uint8_t v = qs >= 0 && ks[j] == qs && Sees(r, qp, kp[j]);
          any |= v, all &= v;
          for (int x = 0; x < g; ++x) visible[(i * g + x) * sn::kMaxSlots + j] = v;
        }
      }
      return all ? kAll : any ? kSome : kNone;
    };
    Item<T, kSimd>(c, rows, it.nrows, 0, c.hkv, (extent + kSlots - 1) / kSlots, desc, vis);
  });
}

// ---- Quest's page bounds (sparse.top_k_pages): q [N, Hq, D], key_min/max [P, Hkv, D] ----
// A page's bound for a query vector: sum_d max(q_d min_d, q_d max_d) = max(q, 0) . max +
// min(q, 0) . min; eight lanes of partial sums (vectorised at each SIMD level's width).
template <int kSimd>
struct SignedDot {
  float operator()(const float* qp, const float* qn, const float* hi, const float* lo, int d) const {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= d; i += 8)
      for (int j = 0; j < 8; ++j) acc[j] += qp[i + j] * hi[i + j] + qn[i + j] * lo[i + j];
    float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < d; ++i) sum += qp[i] * hi[i] + qn[i] * lo[i];
    return sum;
  }
};
#if SPLASH_X86
template <>
struct SignedDot<sn::kAvx2> {
  SPLASH_AVX2 float operator()(const float* qp, const float* qn, const float* hi, const float* lo,
                               int d) const {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= d; i += 8) {
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(qp + i), _mm256_loadu_ps(hi + i), acc);
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(qn + i), _mm256_loadu_ps(lo + i), acc);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (; i < d; ++i) sum += qp[i] * hi[i] + qn[i] * lo[i];
    return sum;
  }
};
#endif

struct Bounds {
  const float *query, *key_min, *key_max;
  const int32_t *table, *seq, *live;
  float* out;  // [S, Hkv, pps]
  int rows, hq, hkv, d, seqs, pps, pages, threads;
};

// One item per sequence: each of its pages' bound per kv head, maxed over its live rows and
// the kv head's group of query heads (-inf: no live row). A page's summaries (every kv head's)
// are one run of the pool's rows; pages come in any order, so the one `kAhead` later is
// prefetched while one is read.
template <int kSimd>
void PageBounds(const Bounds& b) {
  constexpr int kAhead = 4;
  const int g = b.hq / b.hkv, row = b.hkv * b.d;  // floats of a page's summaries
  std::vector<std::vector<int>> rows_of(b.seqs);
  for (int r = 0; r < b.rows; ++r)
    if (b.live[r] && b.seq[r] >= 0 && b.seq[r] < b.seqs) rows_of[b.seq[r]].push_back(r);
  std::vector<int64_t> cost(b.seqs);
  for (int s = 0; s < b.seqs; ++s) cost[s] = static_cast<int64_t>(rows_of[s].size());
  sn::RunItems(cost, b.threads, [&](int s) {
    float* out = b.out + static_cast<int64_t>(s) * b.hkv * b.pps;  // [Hkv, pps]
    std::fill(out, out + static_cast<int64_t>(b.hkv) * b.pps,
              -std::numeric_limits<float>::infinity());
    const int n = static_cast<int>(rows_of[s].size());
    if (n == 0) return;
    std::vector<float> pos(static_cast<size_t>(n) * b.hq * b.d), neg(pos.size());
    for (int i = 0; i < n; ++i) {  // the rows' query vectors [n, Hq, D], split by sign
      const float* q = b.query + static_cast<int64_t>(rows_of[s][i]) * b.hq * b.d;
      for (int x = 0; x < b.hq * b.d; ++x)
        pos[i * b.hq * b.d + x] = std::max(q[x], 0.0f), neg[i * b.hq * b.d + x] = std::min(q[x], 0.0f);
    }
    const int32_t* table = b.table + static_cast<int64_t>(s) * b.pps;
    auto page = [&](int p) { return std::min(std::max(table[p], 0), b.pages - 1); };
    const SignedDot<kSimd> dot;
    for (int p = 0; p < b.pps; ++p) {
      if (p + kAhead < b.pps) {
        const int64_t next = static_cast<int64_t>(page(p + kAhead)) * row;
        sn::Prefetch(b.key_max + next, row * sizeof(float));
        sn::Prefetch(b.key_min + next, row * sizeof(float));
      }
      const int64_t at = static_cast<int64_t>(page(p)) * row;
      for (int h = 0; h < b.hkv; ++h) {
        float best = -std::numeric_limits<float>::infinity();
        for (int i = 0; i < n; ++i)
          for (int x = 0; x < g; ++x) {
            const int64_t v = (static_cast<int64_t>(i) * b.hq + h * g + x) * b.d;
            best = std::max(best, dot(&pos[v], &neg[v], b.key_max + at + h * b.d,
                                      b.key_min + at + h * b.d, b.d));
          }
        out[static_cast<int64_t>(h) * b.pps + p] = best;
      }
    }
  });
}

ffi::Error BoundsImpl(ffi::Buffer<ffi::F32> query, ffi::Buffer<ffi::F32> key_min,
                      ffi::Buffer<ffi::F32> key_max, ffi::Buffer<ffi::S32> table,
                      ffi::Buffer<ffi::S32> seq, ffi::Buffer<ffi::S32> live,
                      ffi::ResultBuffer<ffi::F32> out, int32_t threads, int32_t simd) {
  const auto qd = query.dimensions(), kd = key_min.dimensions(), td = table.dimensions();
  const Bounds b{query.typed_data(), key_min.typed_data(), key_max.typed_data(),
                 table.typed_data(), seq.typed_data(), live.typed_data(), out->typed_data(),
                 static_cast<int>(qd[0]), static_cast<int>(qd[1]), static_cast<int>(kd[1]),
                 static_cast<int>(qd[2]), static_cast<int>(td[0]), static_cast<int>(td[1]),
                 static_cast<int>(kd[0]), std::max(1, static_cast<int>(threads))};
  if (std::min(simd, sn::CpuSimd()) >= sn::kAvx2) PageBounds<sn::kAvx2>(b);
  else PageBounds<sn::kPortable>(b);
  return ffi::Error::Success();
}

// The storage type of a buffer, and the kernel for it: the highest SIMD level the CPU has, up
// to `simd` (sn::Simd; lower levels are asked for by tests and comparisons).
template <template <typename, int> class Run, typename T, typename Args>
void AtLevel(int level, const Common& c, const Args& a) {
  if (level >= sn::kAvx512) Run<T, sn::kAvx512>()(c, a);
  else if (level >= sn::kAvx2) Run<T, sn::kAvx2>()(c, a);
  else Run<T, sn::kPortable>()(c, a);
}

template <template <typename, int> class Run, typename Args>
ffi::Error Dispatch(ffi::DataType type, int simd, const Common& c, const Args& a) {
  const int level = std::min(simd, sn::CpuSimd());
  switch (type) {
    case ffi::DataType::F32: AtLevel<Run, float>(level, c, a); break;
    case ffi::DataType::BF16: AtLevel<Run, sn::Bf16>(level, c, a); break;
    case ffi::DataType::F16: AtLevel<Run, sn::F16>(level, c, a); break;
    case ffi::DataType::S8: AtLevel<Run, int8_t>(level, c, a); break;
    case ffi::DataType::F8E4M3FN: AtLevel<Run, sn::E4m3>(level, c, a); break;
    case ffi::DataType::F8E5M2: AtLevel<Run, sn::E5m2>(level, c, a); break;
    default: return ffi::Error::InvalidArgument("splash_hk native: unsupported key/value dtype");
  }
  return ffi::Error::Success();
}

template <typename T, int kSimd> struct RunPaged {
  void operator()(const Common& c, const Lists& l) { Paged<T, kSimd>(c, l); }
};
template <typename T, int kSimd> struct RunCache {
  void operator()(const Common& c, const Rows& r) { Cache<T, kSimd>(c, r); }
};

Common MakeCommon(ffi::Buffer<ffi::F32> query, ffi::AnyBuffer key, ffi::Buffer<ffi::F32> key_scale,
                  ffi::AnyBuffer value, ffi::Buffer<ffi::F32> value_scale,
                  ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::F32> slopes,
                  ffi::Buffer<ffi::S32> q_pos, ffi::ResultBuffer<ffi::F32> out,
                  ffi::ResultBuffer<ffi::F32> lse, int hkv, int32_t quantized, int32_t threads,
                  float soft_cap, int32_t alibi) {
  const auto qd = query.dimensions();
  const int rank = static_cast<int>(qd.size());
  return Common{query.typed_data(), key.untyped_data(), value.untyped_data(),
                quantized ? key_scale.typed_data() : nullptr,
                quantized ? value_scale.typed_data() : nullptr, sinks.typed_data(),
                alibi ? slopes.typed_data() : nullptr, q_pos.typed_data(), out->typed_data(),
                lse->typed_data(), static_cast<int>(qd[rank - 2]), hkv,
                static_cast<int>(qd[rank - 1]),
                static_cast<int>(value.dimensions()[value.dimensions().size() - 1]),
                std::max(1, static_cast<int>(threads)), soft_cap};
}

ffi::Error PagedImpl(ffi::Buffer<ffi::F32> query, ffi::AnyBuffer key, ffi::Buffer<ffi::F32> key_scale,
                     ffi::AnyBuffer value, ffi::Buffer<ffi::F32> value_scale,
                     ffi::Buffer<ffi::S32> blocks, ffi::Buffer<ffi::S32> first_key,
                     ffi::Buffer<ffi::S32> count, ffi::Buffer<ffi::S32> order,
                     ffi::Buffer<ffi::S32> offset, ffi::Buffer<ffi::S32> rows,
                     ffi::Buffer<ffi::S32> lo, ffi::Buffer<ffi::S32> hi,
                     ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::F32> slopes,
                     ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> first_new,
                     ffi::Buffer<ffi::S32> first_row, ffi::Buffer<ffi::S32> enter,
                     ffi::Buffer<ffi::S32> leave, ffi::ResultBuffer<ffi::F32> out,
                     ffi::ResultBuffer<ffi::F32> lse, float soft_cap, int32_t threads,
                     int32_t simd, int32_t quantized, int32_t alibi, int32_t tree) {
  const auto kd = key.dimensions(), bd = blocks.dimensions();
  const Common c = MakeCommon(query, key, key_scale, value, value_scale, sinks, slopes, pos, out,
                              lse, static_cast<int>(kd[1]), quantized, threads, soft_cap, alibi);
  Clear(c, query.dimensions()[0]);
  const Lists l{blocks.typed_data(), first_key.typed_data(), count.typed_data(),
                order.typed_data(), offset.typed_data(), rows.typed_data(), lo.typed_data(),
                hi.typed_data(), static_cast<int>(bd[0]), static_cast<int>(bd[1]),
                static_cast<int>(bd[2]), static_cast<int>(kd[2]),
                TreeRows{first_new.typed_data(), first_row.typed_data(),
                         tree ? enter.typed_data() : nullptr, leave.typed_data(),
                         pos.typed_data(), static_cast<int>(query.dimensions()[0])}};
  return Dispatch<RunPaged>(key.element_type(), simd, c, l);
}

ffi::Error CacheImpl(ffi::Buffer<ffi::F32> query, ffi::AnyBuffer key, ffi::Buffer<ffi::F32> key_scale,
                     ffi::AnyBuffer value, ffi::Buffer<ffi::F32> value_scale,
                     ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> q_seg,
                     ffi::Buffer<ffi::S32> kv_pos, ffi::Buffer<ffi::S32> kv_seg,
                     ffi::Buffer<ffi::S32> extent, ffi::Buffer<ffi::F32> sinks,
                     ffi::Buffer<ffi::F32> slopes, ffi::ResultBuffer<ffi::F32> out,
                     ffi::ResultBuffer<ffi::F32> lse, float soft_cap, int32_t threads,
                     int32_t simd, int32_t quantized, int32_t alibi, int32_t causal, int32_t left,
                     int32_t right, int32_t chunk) {
  const auto qd = query.dimensions(), kd = key.dimensions();
  const Common c = MakeCommon(query, key, key_scale, value, value_scale, sinks, slopes, q_pos,
                              out, lse, static_cast<int>(kd[2]), quantized, threads, soft_cap,
                              alibi);
  Clear(c, qd[0] * qd[1]);
  const Rows r{q_pos.typed_data(), q_seg.typed_data(), kv_pos.typed_data(), kv_seg.typed_data(),
               extent.typed_data(), static_cast<int>(qd[0]), static_cast<int>(qd[1]),
               static_cast<int>(kd[1]), causal, left, right, chunk};
  return Dispatch<RunCache>(key.element_type(), simd, c, r);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SplashPagedDecode, PagedImpl,
    ffi::Ffi::Bind()
        .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
        .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
        .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
        .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S32>>()
        .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
        .Arg<ffi::Buffer<ffi::S32>>()
        .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>()
        .Attr<float>("soft_cap").Attr<int32_t>("threads").Attr<int32_t>("simd")
        .Attr<int32_t>("quantized")
        .Attr<int32_t>("alibi").Attr<int32_t>("tree"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SplashCacheDecode, CacheImpl,
    ffi::Ffi::Bind()
        .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
        .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
        .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
        .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>()
        .Attr<float>("soft_cap").Attr<int32_t>("threads").Attr<int32_t>("simd")
        .Attr<int32_t>("quantized")
        .Attr<int32_t>("alibi").Attr<int32_t>("causal").Attr<int32_t>("left").Attr<int32_t>("right")
        .Attr<int32_t>("chunk"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SplashPageBounds, BoundsImpl,
    ffi::Ffi::Bind()
        .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
        .Ret<ffi::Buffer<ffi::F32>>()
        .Attr<int32_t>("threads").Attr<int32_t>("simd"));
