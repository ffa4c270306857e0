// CPU kernels for the decode step (kvtier/kernels/cpu_ops.py builds and loads this file).
//
// A CPU decode step of a small model is bound by per-op overhead, not by bytes: SmolLM2-135M ran
// ~63 torch ops a layer (~1,900 a step), and its paged attention copied every cached K/V row three
// times (gather, head-major reshape, fp32 cast) before two batched matmuls. Each function here is
// one call doing what several torch ops did, reading the page pool in place:
//
//   rms_norm      x fp32 [T, H] -> [T, H] in out_dtype   (was pow, mean, add, rsqrt, mul, mul, cast)
//   rope_         qkv [T, (Hq + 2 Hkv) D] rotated in place, per-head RMSNorm first (Qwen3)
//   kv_store      K/V rows -> their slots of a plain (fp32 / bf16 / fp16) page pool
//   paged_decode  one query row per sequence over its pages, split-K across threads
//   paged_decode_lists  the same over each kv head's own selected pages (retrieval attention)
//   quest_scores  retrieval's Quest page scores over the candidates' summary rows in place
//   silu_mul      gu [T, 2I] -> silu(gu[:, :I]) * gu[:, I:]
//   q4v_gemm      x @ W^T over 4-bit codes with AVX512-VNNI integer dot products (torch's int4pack
//                 kernel converts every code to fp32 first: ~1.7x slower at one row)
//
// Each has its PyTorch reference (kvtier/kernels/fused.py, kvtier/layers/attention.py,
// kvtier/kv/formats.py) and rounds where the reference rounds: fp32 arithmetic, then one rounding
// to the storage dtype per torch op the reference runs (-ffp-contract=off keeps products and sums
// separately rounded, as torch's CPU kernels compute them, except where torch fuses them itself). The reductions (a norm's sum of
// squares, attention's dot products and softmax) sum in another order than torch's, so results
// agree to rounding, not bit for bit.
//
// Threads: at::parallel_for, i.e. torch's own OpenMP team (this library links the libgomp torch
// has already loaded), never a second pool.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using c10::BFloat16;
using c10::Half;

inline float to_f(float x) { return x; }
inline float to_f(BFloat16 x) { return static_cast<float>(x); }
inline float to_f(Half x) { return static_cast<float>(x); }

template <typename T>
inline T from_f(float x) { return static_cast<T>(x); }

// Round through T and back: the value torch holds after an op whose result dtype is T.
template <typename T>
inline float round_to(float x) { return to_f(from_f<T>(x)); }

#define KVT_DISPATCH_FLOAT(DTYPE, NAME, ...)                                         \
  [&] {                                                                               \
    switch (DTYPE) {                                                                  \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }              \
      case at::kBFloat16: { using scalar_t = BFloat16; return __VA_ARGS__(); }        \
      case at::kHalf: { using scalar_t = Half; return __VA_ARGS__(); }                \
      default: TORCH_CHECK(false, NAME ": unsupported dtype ", DTYPE);               \
    }                                                                                 \
  }()

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

// ------------------------------------------------------------------------------------ rms_norm

// y = x * rsqrt(mean(x^2) + eps) * w, all fp32 (F.rms_norm on an fp32 input), then one rounding
// to out_dtype (the decoder's cast of the normalised residual to the matmul dtype).
template <typename O>
void rms_norm_rows(const float* x, const float* w, O* y, int64_t rows, int64_t h, int64_t xs, int64_t ys,
                   float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * xs;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) ss += xr[i] * xr[i];
      const float rstd = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
      O* yr = y + r * ys;
      for (int64_t i = 0; i < h; ++i) {
        const float n = xr[i] * rstd;
        yr[i] = from_f<O>(n * w[i]);
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, at::ScalarType out_dtype) {
  check_cpu(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rms_norm: fp32 x and weight");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x [T, H] with contiguous rows");
  auto wc = w.contiguous();
  const int64_t rows = x.size(0), h = x.size(1);
  TORCH_CHECK(wc.numel() == h, "rms_norm: weight has ", wc.numel(), " entries, rows have ", h);
  auto y = at::empty({rows, h}, x.options().dtype(out_dtype));
  KVT_DISPATCH_FLOAT(out_dtype, "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<scalar_t>(), rows, h,
                            x.stride(0), h, static_cast<float>(eps));
  });
  return y;
}

// ------------------------------------------------------------------------------------ rope_

// One head of d values at p, in place: optional per-head RMSNorm (HF's: fp32 statistics, the
// normalised value rounded to T, times the weight, rounded again; in fp32 F.rms_norm's x * r * w),
// then rotary as RotaryEmbedding's reference computes it: a = round(x * cos), out =
// round(fma(roll(x, d/2), sin_signed, a)) (torch's CPU addcmul is an fma).
template <typename T>
inline void rope_head(T* p, const T* cs, const T* sn, const T* nw, int64_t d, float eps, float* buf) {
  for (int64_t i = 0; i < d; ++i) buf[i] = to_f(p[i]);
  if (nw != nullptr) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < d; ++i) ss += buf[i] * buf[i];
    const float rstd = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) {
      if constexpr (std::is_same_v<T, float>) {
        buf[i] = buf[i] * rstd * nw[i];
      } else {
        buf[i] = round_to<T>(to_f(nw[i]) * round_to<T>(buf[i] * rstd));
      }
    }
  }
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float rolled = buf[i < half ? i + half : i - half];
    const float a = round_to<T>(buf[i] * to_f(cs[i]));
    p[i] = from_f<T>(std::fma(rolled, to_f(sn[i]), a));  // torch's CPU addcmul is an fma
  }
}

void rope_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin_signed, int64_t hq, int64_t hkv,
           int64_t d, const c10::optional<at::Tensor>& q_weight, const c10::optional<at::Tensor>& k_weight,
           double eps) {
  check_cpu(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rope_: qkv [T, W] with contiguous rows");
  TORCH_CHECK(qkv.size(1) >= (hq + hkv) * d && d % 2 == 0, "rope_: qkv too narrow or odd head_dim");
  TORCH_CHECK(q_weight.has_value() == k_weight.has_value(), "rope_: pass both q and k norm weights, or neither");
  const int64_t t = qkv.size(0);
  auto c = cos.reshape({t, d}).contiguous(), s = sin_signed.reshape({t, d}).contiguous();
  TORCH_CHECK(c.scalar_type() == qkv.scalar_type() && s.scalar_type() == qkv.scalar_type(),
              "rope_: cos / sin in qkv's dtype");
  at::Tensor qw, kw;
  if (q_weight.has_value()) {
    qw = q_weight->to(qkv.scalar_type()).contiguous();
    kw = k_weight->to(qkv.scalar_type()).contiguous();
    TORCH_CHECK(qw.numel() == d && kw.numel() == d, "rope_: norm weights of head_dim entries");
  }
  const int64_t heads = hq + hkv, rs = qkv.stride(0);
  KVT_DISPATCH_FLOAT(qkv.scalar_type(), "rope_", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = c.data_ptr<scalar_t>();
    const scalar_t* sp = s.data_ptr<scalar_t>();
    const scalar_t* qwp = qw.defined() ? qw.data_ptr<scalar_t>() : nullptr;
    const scalar_t* kwp = kw.defined() ? kw.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, t * heads, 64, [&](int64_t i0, int64_t i1) {
      std::vector<float> buf(d);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t row = i / heads, head = i % heads;
        rope_head<scalar_t>(base + row * rs + head * d, cp + row * d, sp + row * d, head < hq ? qwp : kwp, d,
                            static_cast<float>(eps), buf.data());
      }
    });
  });
}

// ------------------------------------------------------------------------------------ kv_store

// Rows k, v [T, Hkv, D] (any row / head strides, contiguous D) -> slots of a page pool layer
// [P, Hkv, ps, D]: slot = page * ps + offset. One rounding to the pool's dtype (the codec's cast).
template <typename S, typename C>
void store_rows(const at::Tensor& src, at::Tensor& cache, const int64_t* slots, int64_t t) {
  const int64_t hkv = cache.size(1), ps = cache.size(2), d = cache.size(3);
  const S* sp = src.data_ptr<S>();
  C* cp = cache.data_ptr<C>();
  const int64_t s0 = src.stride(0), s1 = src.stride(1);
  for (int64_t i = 0; i < t; ++i) {
    const int64_t page = slots[i] / ps, off = slots[i] % ps;
    for (int64_t h = 0; h < hkv; ++h) {
      const S* row = sp + i * s0 + h * s1;
      C* dst = cp + ((page * hkv + h) * ps + off) * d;
      for (int64_t j = 0; j < d; ++j) dst[j] = from_f<C>(to_f(row[j]));
    }
  }
}

void kv_store(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v) {
  for (auto* c : {&k_cache, &v_cache}) {
    check_cpu(*c, "cache");
    TORCH_CHECK(c->dim() == 4 && c->is_contiguous(), "kv_store: contiguous [P, Hkv, ps, D] pages");
  }
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1, "kv_store: k, v [T, Hkv, D]");
  TORCH_CHECK(k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(3) && v.sizes() == k.sizes(),
              "kv_store: rows do not match the pages' heads / head_dim");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == k.size(0), "kv_store: one int64 slot per row");
  auto sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t t = k.size(0), cap = k_cache.size(0) * k_cache.size(2);
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < cap, "kv_store: slot ", sp[i], " out of range");
  KVT_DISPATCH_FLOAT(k.scalar_type(), "kv_store", [&] {
    using S = scalar_t;
    KVT_DISPATCH_FLOAT(k_cache.scalar_type(), "kv_store", [&] {
      store_rows<S, scalar_t>(k, k_cache, sp, t);
      store_rows<S, scalar_t>(v.scalar_type() == k.scalar_type() ? v : v.to(k.scalar_type()), v_cache, sp, t);
    });
  });
}

// ------------------------------------------------------------------------------------ paged_decode

// exp(x), vectorizable: 2^n * e^f with n = round(x / ln 2), f in [-ln2/2, ln2/2], e^f by a
// degree-6 polynomial (relative error ~2e-7, a couple of fp32 ulps, as torch's own vectorized
// exp). x is clamped to [-87, 88.8]: below, the result is ~1e-38 where expf gives a denormal or
// 0 (nothing a softmax or silu can see); above, n = 128 makes it inf, as expf overflows.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.8f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float f = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;  // ln 2 in two parts
  float p = 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
// 16 values of a K / V row as fp32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// Attention of one query row per sequence (decode) over the first seq_lens[b] tokens of its
// pages, read in place. Work items are (sequence, kv head, split of the context): the query heads
// of a GQA group read each K/V row once together. Each item keeps its softmax max, sum and
// unnormalised output (fp32); a second pass merges the splits of each (sequence, query head).
#ifndef PREFETCH_PAGES
#define PREFETCH_PAGES 2  // how far ahead for_rows prefetches (pages)
#endif

// Calls f(t, row) for t in [t0, t1) with row = the token's K (or V) row of kv head h: page by page,
// so the page lookup and the offset division happen once a page, not once a token.
template <typename C, typename F>
inline void for_rows(const C* cache, const int64_t* table, int64_t t0, int64_t t1, int64_t h, int64_t hkv,
                     int64_t ps, int64_t d, F&& f) {
  int64_t t = t0;
  const int64_t last = (t1 - 1) / ps;
  while (t < t1) {
    const int64_t off0 = t % ps, cnt = std::min(ps - off0, t1 - t), page = t / ps;
    if (page + PREFETCH_PAGES <= last) {  // scattered pages: ask for a later one while this one runs
      const char* next = reinterpret_cast<const char*>(cache + (table[page + PREFETCH_PAGES] * hkv + h) * ps * d);
      for (int64_t b = 0; b < ps * d * static_cast<int64_t>(sizeof(C)); b += 64) __builtin_prefetch(next + b);
    }
    const C* base = cache + ((table[page] * hkv + h) * ps + off0) * d;
    for (int64_t i = 0; i < cnt; ++i) f(t + i, base + i * d);
    t += cnt;
  }
}

template <typename C>
void decode_split(const float* q, const C* kc, const C* vc, const int64_t* table, int64_t t0, int64_t t1,
                  int64_t h, int64_t hkv, int64_t ps, int64_t d, int64_t g, float scale, float* part,
                  std::vector<float>& scores, std::vector<float>& kbuf) {
  const int64_t n = t1 - t0;
  scores.resize(static_cast<size_t>(g * std::max<int64_t>(n, 1)));
  kbuf.resize(static_cast<size_t>(d));
  float* rp = kbuf.data();
  float* sc = scores.data();
  // scores [g, n]: each K row is converted once and dotted with the group's query heads
  bool done = false;
#if defined(__AVX512F__)
  if (d % 16 == 0 && d <= 256) {
    const int64_t chunks = d / 16;
    for_rows(kc, table, t0, t1, h, hkv, ps, d, [&](int64_t t, const C* kr) {
      __m512 kv[16];
      for (int64_t c = 0; c < chunks; ++c) kv[c] = load16(kr + 16 * c);
      for (int64_t j = 0; j < g; ++j) {
        const float* qj = q + j * d;
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qj), kv[0]);
        for (int64_t c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16 * c), kv[c], acc);
        sc[j * n + (t - t0)] = _mm512_reduce_add_ps(acc) * scale;
      }
    });
    done = true;
  }
#endif
  if (!done) {
    for_rows(kc, table, t0, t1, h, hkv, ps, d, [&](int64_t t, const C* kr) {
      for (int64_t i = 0; i < d; ++i) rp[i] = to_f(kr[i]);
      for (int64_t j = 0; j < g; ++j) {
        const float* qj = q + j * d;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < d; ++i) acc += qj[i] * rp[i];
        sc[j * n + (t - t0)] = acc * scale;
      }
    });
  }
  // per query head: the split's max and sum; part = [d outputs, max, sum]
  for (int64_t j = 0; j < g; ++j) {
    float* sj = sc + j * n;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) m = std::max(m, sj[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      sj[i] = exp_approx(sj[i] - m);
      sum += sj[i];
    }
    float* o = part + j * (d + 2);
    std::fill(o, o + d, 0.f);
    o[d] = m;
    o[d + 1] = sum;
  }
#if defined(__AVX512F__)
  if (d % 16 == 0 && g <= 16) {
    // one 16-wide column block of V at a time, the group's accumulators in registers
    for (int64_t c = 0; c < d / 16; ++c) {
      __m512 acc[16];
      for (int64_t j = 0; j < g; ++j) acc[j] = _mm512_setzero_ps();
      for_rows(vc, table, t0, t1, h, hkv, ps, d, [&](int64_t t, const C* vr) {
        const __m512 v = load16(vr + 16 * c);
        for (int64_t j = 0; j < g; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(sc[j * n + (t - t0)]), v, acc[j]);
      });
      for (int64_t j = 0; j < g; ++j) _mm512_storeu_ps(part + j * (d + 2) + 16 * c, acc[j]);
    }
    return;
  }
#endif
  for_rows(vc, table, t0, t1, h, hkv, ps, d, [&](int64_t t, const C* vr) {
    for (int64_t i = 0; i < d; ++i) rp[i] = to_f(vr[i]);
    for (int64_t j = 0; j < g; ++j) {
      const float p = sc[j * n + (t - t0)];
      float* o = part + j * (d + 2);
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) o[i] += p * rp[i];
    }
  });
}

// The split-K attention both decode entry points share: row r's query heads of kv head h attend
// to the first lens[r * ls_r + h * ls_h] positions of the page list at tables + r * ts_r + h * ts_h
// (position t in page t / ps of that list, row t % ps). Splits per (row, head) spread the work over
// the threads even for one sequence of few kv heads; their partials merge by log-sum-exp.
at::Tensor decode_lists(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const int64_t* tp, int64_t ts_r, int64_t ts_h, const int64_t* lp, int64_t ls_r,
                        int64_t ls_h, double scale, int64_t min_split) {
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = k_cache.size(1), ps = k_cache.size(2), g = hq / hkv;
  int64_t longest = 0;
  for (int64_t r = 0; r < b; ++r)
    for (int64_t h = 0; h < hkv; ++h) longest = std::max(longest, lp[r * ls_r + h * ls_h]);
  auto qf = q.to(at::kFloat).contiguous();
  const int64_t threads = at::get_num_threads();
  int64_t splits = 1;
  if (longest > 0) {
    splits = std::max<int64_t>(1, std::min<int64_t>((2 * threads + b * hkv - 1) / (b * hkv),
                                                    longest / std::max<int64_t>(min_split, 1)));
  }
  const int64_t chunk = longest > 0 ? (longest + splits - 1) / splits : 1;
  auto parts = at::empty({b, hkv, splits, g, d + 2}, qf.options());
  float* pp = parts.data_ptr<float>();
  const float* qp = qf.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  KVT_DISPATCH_FLOAT(k_cache.scalar_type(), "paged_decode", [&] {
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, b * hkv * splits, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> scores, kbuf;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t s = i % splits, h = (i / splits) % hkv, row = i / (splits * hkv);
        const int64_t len = lp[row * ls_r + h * ls_h];
        const int64_t t0 = std::min(len, s * chunk), t1 = std::min(len, (s + 1) * chunk);
        float* part = pp + i * g * (d + 2);
        if (t0 >= t1) {  // an empty split (or an empty sequence): weight zero in the merge
          for (int64_t j = 0; j < g; ++j) {
            std::fill(part + j * (d + 2), part + j * (d + 2) + d, 0.f);
            part[j * (d + 2) + d] = -std::numeric_limits<float>::infinity();
            part[j * (d + 2) + d + 1] = 0.f;
          }
          continue;
        }
        decode_split<scalar_t>(qp + (row * hq + h * g) * d, kc, vc, tp + row * ts_r + h * ts_h, t0, t1, h, hkv,
                               ps, d, g, sc, part, scores, kbuf);
      }
    });
  });
  const bool direct = q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
  auto out = at::empty({b, hq, d}, q.options().dtype(direct ? q.scalar_type() : at::kFloat));
  KVT_DISPATCH_FLOAT(out.scalar_type(), "paged_decode", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, b * hq, 64, [&](int64_t i0, int64_t i1) {
      std::vector<float> acc(d);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t row = i / hq, head = i % hq, h = head / g, j = head % g;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < splits; ++s)
          m = std::max(m, pp[(((row * hkv + h) * splits + s) * g + j) * (d + 2) + d]);
        std::fill(acc.begin(), acc.end(), 0.f);
        float total = 0.f;
        for (int64_t s = 0; s < splits; ++s) {
          const float* part = pp + (((row * hkv + h) * splits + s) * g + j) * (d + 2);
          if (part[d + 1] == 0.f) continue;
          const float w = std::exp(part[d] - m);
          total += w * part[d + 1];
          for (int64_t x = 0; x < d; ++x) acc[x] += w * part[x];
        }
        scalar_t* o = op + (row * hq + head) * d;
        // nothing to attend (a padding row, a kv head with no live key): zeros, as the
        // references give (their fully masked softmax is NaN, set to 0)
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t x = 0; x < d; ++x) o[x] = from_f<scalar_t>(acc[x] * inv);
      }
    });
  });
  return direct ? out : out.to(q.scalar_type());
}

void check_pages(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const char* name) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3, name, ": q [B, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              name, ": contiguous K / V pages [P, Hkv, ps, D] of one dtype");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(1) == 0,
              name, ": head_dim / GQA grouping mismatch");
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                        int64_t min_split) {
  check_pages(q, k_cache, v_cache, "paged_decode");
  const int64_t b = q.size(0), ps = k_cache.size(2);
  auto table = block_table.to(at::kLong).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(table.dim() == 2 && table.size(0) >= b && lens.numel() >= b, "paged_decode: one table row and length per sequence");
  const int64_t maxp = table.size(1), pages = k_cache.size(0);
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(lp[i] >= 0 && lp[i] <= maxp * ps, "paged_decode: sequence ", i, " longer than its table");
    for (int64_t p = 0; p < (lp[i] + ps - 1) / ps; ++p)
      TORCH_CHECK(tp[i * maxp + p] >= 0 && tp[i * maxp + p] < pages, "paged_decode: page id out of range");
  }
  return decode_lists(q, k_cache, v_cache, tp, maxp, 0, lp, 1, 0, scale, min_split);
}

// Retrieval decode: each (row, kv head) attends to its own selected pages. page_ids / page_idx
// [R, Hkv, N]: entry n is page page_ids[.., n], the page_idx[.., n]-th page of its sequence (-1:
// no entry); positions at or past ctx[r] are masked (only a sequence's last page can hold
// fewer than ps of them). The live entries are listed with that partial page last, so the
// list's positions run contiguously for decode_split.
at::Tensor paged_decode_lists(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& page_ids, const at::Tensor& page_idx, const at::Tensor& ctx,
                              double scale, int64_t min_split) {
  check_pages(q, k_cache, v_cache, "paged_decode_lists");
  const int64_t r = q.size(0), hkv = k_cache.size(1), ps = k_cache.size(2), pages = k_cache.size(0);
  auto ids = page_ids.to(at::kLong).contiguous();
  auto idx = page_idx.to(at::kLong).contiguous();
  auto lens_in = ctx.to(at::kLong).contiguous();
  TORCH_CHECK(ids.dim() == 3 && ids.size(0) == r && ids.size(1) == hkv && idx.sizes() == ids.sizes() &&
                  lens_in.numel() == r, "paged_decode_lists: page_ids / page_idx [R, Hkv, N], ctx [R]");
  const int64_t n = ids.size(2);
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* xp = idx.data_ptr<int64_t>();
  const int64_t* cp = lens_in.data_ptr<int64_t>();
  auto table = at::empty({r, hkv, std::max<int64_t>(n, 1)}, ids.options());
  auto lens = at::empty({r, hkv}, ids.options());
  int64_t* tp = table.data_ptr<int64_t>();
  int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < r * hkv; ++i) {
    const int64_t c = cp[i / hkv];
    int64_t full = 0, part_page = -1, part_rows = 0;
    for (int64_t e = 0; e < n; ++e) {
      const int64_t x = xp[i * n + e];
      if (x < 0 || x * ps >= c) continue;  // no entry, or a page wholly past the context
      const int64_t id = ip[i * n + e];
      TORCH_CHECK(id >= 0 && id < pages, "paged_decode_lists: page id out of range");
      const int64_t rows = std::min(ps, c - x * ps);
      if (rows < ps) {
        TORCH_CHECK(part_page < 0, "paged_decode_lists: two partial pages in one list");
        part_page = id;
        part_rows = rows;
      } else {
        tp[i * n + full++] = id;
      }
    }
    if (part_page >= 0) tp[i * n + full] = part_page;
    lp[i] = full * ps + part_rows;
  }
  return decode_lists(q, k_cache, v_cache, tp, hkv * n, n, lp, hkv, 1, scale, min_split);
}

// ------------------------------------------------------------------------------------ quest_scores

// Retrieval's page scores (layers/retrieval.py page_scores, Quest): for row r, kv head h and
// candidate page p = cand[r, c], the bound of each query head j of the group on q_j . k over the
// page's keys, sum_d max(q_jd kmin_pd, q_jd kmax_pd) = sum_d max(q_jd, 0) kmax_pd + min(q_jd, 0) kmin_pd,
// summed over the group (quest) or its max (quest-max); a page with no keys (count 0) scores +inf.
// One pass over each candidate's summary rows, none gathered into copies first.
at::Tensor quest_scores(const at::Tensor& qg, const at::Tensor& kmin, const at::Tensor& kmax,
                        const at::Tensor& count, const at::Tensor& cand, bool use_max) {
  check_cpu(qg, "qg");
  TORCH_CHECK(qg.dim() == 4 && qg.scalar_type() == at::kFloat, "quest_scores: qg [R, Hkv, G, D] fp32");
  TORCH_CHECK(kmin.dim() == 3 && kmin.scalar_type() == at::kFloat && kmin.is_contiguous() && kmax.sizes() == kmin.sizes() &&
                  kmax.scalar_type() == at::kFloat && kmax.is_contiguous(), "quest_scores: kmin / kmax [P, Hkv, D] fp32");
  const int64_t r = qg.size(0), hkv = qg.size(1), g = qg.size(2), d = qg.size(3), pages = kmin.size(0);
  TORCH_CHECK(kmin.size(1) == hkv && kmin.size(2) == d, "quest_scores: summaries / query shapes differ");
  auto cnt = count.to(at::kInt).contiguous();
  auto ids = cand.to(at::kLong).contiguous();
  TORCH_CHECK(cnt.numel() == pages && ids.dim() == 2 && ids.size(0) == r, "quest_scores: count [P], cand [R, C]");
  const int64_t c = ids.size(1);
  auto q = qg.contiguous();
  // the group's queries split by sign: [R, Hkv, G, D] each
  auto qpos = q.clamp_min(0.0).contiguous(), qneg = q.clamp_max(0.0).contiguous();
  const float* pp = qpos.data_ptr<float>();
  const float* np = qneg.data_ptr<float>();
  const float* lo = kmin.data_ptr<float>();
  const float* hi = kmax.data_ptr<float>();
  const int32_t* cp = cnt.data_ptr<int32_t>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < r * c; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < pages, "quest_scores: page id out of range (host-tier pages take the PyTorch path)");
  auto out = at::empty({r, hkv, c}, q.options());
  float* op = out.data_ptr<float>();
  const float inf = std::numeric_limits<float>::infinity();
  // work items: (row, kv head, block of QUEST_COLS candidates), so one row's few kv heads still
  // spread over every thread
  constexpr int64_t QUEST_COLS = 128;
  const int64_t blocks = (c + QUEST_COLS - 1) / QUEST_COLS;
  at::parallel_for(0, r * hkv * blocks, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t i = w / blocks, c0 = (w % blocks) * QUEST_COLS, c1 = std::min(c, c0 + QUEST_COLS);
      const int64_t row = i / hkv, h = i % hkv;
      const float* qp = pp + i * g * d;
      const float* qn = np + i * g * d;
      for (int64_t col = c0; col < c1; ++col) {
        const int64_t page = ip[row * c + col];
        if (cp[page] == 0) {
          op[i * c + col] = inf;
          continue;
        }
        const float* kl = lo + (page * hkv + h) * d;
        const float* kh = hi + (page * hkv + h) * d;
        float best = -inf, total = 0.f;
        for (int64_t j = 0; j < g; ++j) {
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t x = 0; x < d; ++x) acc += qp[j * d + x] * kh[x] + qn[j * d + x] * kl[x];
          best = std::max(best, acc);
          total += acc;
        }
        op[i * c + col] = use_max ? best : total;
      }
    }
  });
  return out;
}

// ------------------------------------------------------------------------------------ silu_mul

// silu(gate) * up as torch computes it in gu's dtype: silu rounded, then the product rounded.
template <typename T>
void silu_mul_rows(const T* src, T* dst, int64_t t, int64_t inter, int64_t rs) {
  at::parallel_for(0, t, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> act(inter);
    float* a = act.data();
    for (int64_t r = r0; r < r1; ++r) {
      const T* gate = src + r * rs;
      const T* up = gate + inter;
#pragma omp simd
      for (int64_t c = 0; c < inter; ++c) {
        const float x = to_f(gate[c]);
        a[c] = x / (1.f + exp_approx(-x));
      }
      T* o = dst + r * inter;
      for (int64_t c = 0; c < inter; ++c) o[c] = from_f<T>(round_to<T>(a[c]) * to_f(up[c]));
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gu) {
  check_cpu(gu, "gu");
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && gu.size(1) % 2 == 0, "silu_mul: gu [T, 2I], contiguous rows");
  const int64_t t = gu.size(0), inter = gu.size(1) / 2;
  auto out = at::empty({t, inter}, gu.options());
  KVT_DISPATCH_FLOAT(gu.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gu.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), t, inter, gu.stride(0));
  });
  return out;
}

// ------------------------------------------------------------------------------------ q4 GEMM (VNNI)

// y = x @ W^T with W in 4-bit codes q (0..15) and per-group fp16 scale / min (w = q scale + min),
// in this file's "q4v" layout, made by kvtier/layers/qlinear.py Int4VNNI.pack:
//   codes  int32 [N / 16, K / 8, 16]: lane r of word (b, j) holds row 16 b + r, columns 8 j .. 8 j + 7,
//          column 8 j + i in bits 4 i .. 4 i + 3
//   sm     fp16  [N / 16, K / G, 2, 16]: (scale, min) of each row's group
// Activations enter the integer dot products as two int8 parts per group of G columns: with
// s = amax / 127, x = s (hi + lo / 256) + e, |e| <= s / 512 (16 bits of the group's range, finer
// than the bf16 the activations come in except for values 2^-8 below the group's largest), so
//   sum_k x q = s (sum hi q + sum lo q / 256)     (AVX512-VNNI vpdpbusd: u8 codes x s8 parts)
//   y = sum_g scale_g s_g (that) + min_g sum_k x                      (fp32)
// Masking the even / odd nibbles of a word gives bytes (q0, q2, q4, q6) and (q1, q3, q5, q7); the
// activation parts are laid out to match (x_parts). Output rounded to x's dtype, or with
// `residual` [M, N]: residual + that rounded value, in the residual's dtype (the fused add).
struct XParts {
  // q4v: [M, K / 8] words of 4 int8 each, the even (0, 2, 4, 6) and odd columns of each 8;
  // q8v: hi_even / lo_even hold [M, K / 4] words of 4 consecutive columns, the odd ones unused
  std::vector<uint32_t> hi_even, hi_odd, lo_even, lo_odd;
  std::vector<float> scale, sum;  // [M, K / G]
};

// x fp32 [M, K] -> its int8 parts per group of `group` columns (see the q4v / q8v comments).
XParts x_parts(const float* x, int64_t m, int64_t k, int64_t group, bool interleaved) {
  XParts p;
  const int64_t groups = k / group, words = interleaved ? k / 8 : k / 4;
  for (auto* v : {&p.hi_even, &p.lo_even}) v->assign(m * words, 0);
  if (interleaved) {
    for (auto* v : {&p.hi_odd, &p.lo_odd}) v->assign(m * words, 0);
  }
  p.scale.assign(m * groups, 0.f);
  p.sum.assign(m * groups, 0.f);
  std::vector<int8_t> hi(k), lo(k);
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    for (int64_t g = 0; g < groups; ++g) {
      float amax = 0.f, sum = 0.f;
      for (int64_t i = g * group; i < (g + 1) * group; ++i) {
        amax = std::max(amax, std::fabs(xr[i]));
        sum += xr[i];
      }
      const float s = amax > 0.f ? amax / 127.f : 1.f;
      const float inv = 1.f / s;
      for (int64_t i = g * group; i < (g + 1) * group; ++i) {
        const float h = std::nearbyint(xr[i] * inv);
        const float l = std::nearbyint((xr[i] - h * s) * inv * 256.f);
        hi[i] = static_cast<int8_t>(std::clamp(h, -127.f, 127.f));
        lo[i] = static_cast<int8_t>(std::clamp(l, -128.f, 127.f));
      }
      p.scale[r * groups + g] = s;
      p.sum[r * groups + g] = sum;
    }
    auto word = [](const std::vector<int8_t>& v, int64_t first, int64_t step) {
      uint32_t w = 0;
      for (int i = 0; i < 4; ++i) w |= static_cast<uint32_t>(static_cast<uint8_t>(v[first + step * i])) << (8 * i);
      return w;
    };
    for (int64_t j = 0; j < words; ++j) {
      if (interleaved) {
        p.hi_even[r * words + j] = word(hi, 8 * j, 2);
        p.hi_odd[r * words + j] = word(hi, 8 * j + 1, 2);
        p.lo_even[r * words + j] = word(lo, 8 * j, 2);
        p.lo_odd[r * words + j] = word(lo, 8 * j + 1, 2);
      } else {
        p.hi_even[r * words + j] = word(hi, 4 * j, 1);
        p.lo_even[r * words + j] = word(lo, 4 * j, 1);
      }
    }
  }
  return p;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__BMI2__)
// x_parts for groups of a multiple of 16 columns, reading x in its own dtype: the same parts, the
// group sums in another order. Bytes first (hi / lo [K] int8 a row), then the words: q8v's are the
// bytes as they lie (4 consecutive columns, little-endian); q4v's even / odd columns of each 8 are
// taken out of the 8 bytes by pext.
template <typename X>
void x_parts_vec(const X* x, int64_t m, int64_t k, int64_t group, bool interleaved, XParts& p) {
  const int64_t groups = k / group, words = interleaved ? k / 8 : k / 4;
  for (auto* v : {&p.hi_even, &p.lo_even}) v->resize(m * words);
  if (interleaved) {
    for (auto* v : {&p.hi_odd, &p.lo_odd}) v->resize(m * words);
  }
  p.scale.resize(m * groups);
  p.sum.resize(m * groups);
  thread_local std::vector<int8_t> hi, lo;
  hi.resize(k);
  lo.resize(k);
  const __m512 lo_min = _mm512_set1_ps(-128.f), lo_max = _mm512_set1_ps(127.f);
  constexpr int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t r = 0; r < m; ++r) {
    const X* xr = x + r * k;
    for (int64_t g = 0; g < groups; ++g) {
      __m512 amax = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
      for (int64_t i = g * group; i < (g + 1) * group; i += 16) {
        const __m512 v = load16(xr + i);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
        sum = _mm512_add_ps(sum, v);
      }
      const float a = _mm512_reduce_max_ps(amax);
      const float sc = a > 0.f ? a / 127.f : 1.f;
      const __m512 s = _mm512_set1_ps(sc), inv = _mm512_set1_ps(1.f / sc), inv256 = _mm512_set1_ps(256.f / sc);
      for (int64_t i = g * group; i < (g + 1) * group; i += 16) {
        const __m512 v = load16(xr + i);
        const __m512 h = _mm512_roundscale_ps(_mm512_mul_ps(v, inv), round);
        __m512 l = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_fnmadd_ps(h, s, v), inv256), round);
        l = _mm512_min_ps(_mm512_max_ps(l, lo_min), lo_max);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(hi.data() + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(h)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(lo.data() + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(l)));
      }
      p.scale[r * groups + g] = sc;
      p.sum[r * groups + g] = _mm512_reduce_add_ps(sum);
    }
    if (!interleaved) {
      std::memcpy(p.hi_even.data() + r * words, hi.data(), k);
      std::memcpy(p.lo_even.data() + r * words, lo.data(), k);
      continue;
    }
    for (int64_t j = 0; j < words; ++j) {
      uint64_t hb, lb;
      std::memcpy(&hb, hi.data() + 8 * j, 8);
      std::memcpy(&lb, lo.data() + 8 * j, 8);
      p.hi_even[r * words + j] = static_cast<uint32_t>(_pext_u64(hb, 0x00FF00FF00FF00FFull));
      p.hi_odd[r * words + j] = static_cast<uint32_t>(_pext_u64(hb, 0xFF00FF00FF00FF00ull));
      p.lo_even[r * words + j] = static_cast<uint32_t>(_pext_u64(lb, 0x00FF00FF00FF00FFull));
      p.lo_odd[r * words + j] = static_cast<uint32_t>(_pext_u64(lb, 0xFF00FF00FF00FF00ull));
    }
  }
}
#endif

// Bytes ahead of the word being read that qv_block asks into L2. The hardware prefetchers alone
// left a decode step's weight stream at ~17 GB/s on a 2-core Xeon (qwen2.5-coder-1.5b, every
// matrix in layer order, nothing else running) where a plain read of 1 GiB reaches ~23; with this
// 6 KiB software prefetch the same pass reads ~23 GB/s (4 KiB: 21.6, 8 KiB: 22.8; into L1: ~20;
// also prefetching the scales and high bits gained nothing). A thread's blocks lie back to back,
// so the address runs on into its next block (past a tensor's end a prefetch does not fault).
constexpr int64_t QV_PREFETCH_BYTES = 6144;

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
// One 16-row block of W against MR rows of x (m0 ..), each word of codes loaded (and, 4-bit,
// unpacked) once for all MR rows; the group sums of the MR rows -> rows_out [MR, 16].
template <int BITS, int MR>
inline void qv_block(const XParts& xp, const int32_t* blk, const int32_t* hb, const Half* smb, int64_t m0,
                     int64_t words, int64_t groups, int64_t wpg, int64_t sms, float min_mult, float* rows_out) {
  const __m512i nib = _mm512_set1_epi32(0x0F0F0F0F);
  const __m512i bit4 = _mm512_set1_epi32(0x10101010);
  const __m512i bit5 = _mm512_set1_epi32(0x20202020);
  constexpr int64_t planes = BITS == 6 ? 2 : 1;  // high-bit planes of q5v / q6v
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i ah[MR], al[MR];
    for (int i = 0; i < MR; ++i) ah[i] = al[i] = _mm512_setzero_si512();
    for (int64_t j = g * wpg; j < (g + 1) * wpg; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(blk + j * 16) + QV_PREFETCH_BYTES, _MM_HINT_T1);
      const __m512i w = _mm512_loadu_si512(blk + j * 16);
      if constexpr (BITS == 4 || BITS == 5 || BITS == 6) {
        __m512i even = _mm512_and_si512(w, nib);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(w, 4), nib);
        if constexpr (BITS != 4) {  // the high bits: slot 2 t (+ 1 odd) of each byte of word j / 4, per plane
          const int t = static_cast<int>(j % 4);
          const int se = 4 - 2 * t, so = 3 - 2 * t;  // left shifts that move each slot to bit 4
          const __m512i h = _mm512_loadu_si512(hb + (j / 4) * 16 * planes);
          const __m512i he = se >= 0 ? _mm512_sll_epi32(h, _mm_cvtsi32_si128(se)) : _mm512_srl_epi32(h, _mm_cvtsi32_si128(-se));
          const __m512i ho = so >= 0 ? _mm512_sll_epi32(h, _mm_cvtsi32_si128(so)) : _mm512_srl_epi32(h, _mm_cvtsi32_si128(-so));
          even = _mm512_ternarylogic_epi32(even, he, bit4, 0xF8);  // even | (he & bit4)
          odd = _mm512_ternarylogic_epi32(odd, ho, bit4, 0xF8);
          if constexpr (BITS == 6) {  // the sixth bits, from the second plane, to bit 5
            const __m512i h2 = _mm512_loadu_si512(hb + (j / 4) * 32 + 16);
            const int se2 = se + 1, so2 = so + 1;
            const __m512i he2 = se2 >= 0 ? _mm512_sll_epi32(h2, _mm_cvtsi32_si128(se2)) : _mm512_srl_epi32(h2, _mm_cvtsi32_si128(-se2));
            const __m512i ho2 = so2 >= 0 ? _mm512_sll_epi32(h2, _mm_cvtsi32_si128(so2)) : _mm512_srl_epi32(h2, _mm_cvtsi32_si128(-so2));
            even = _mm512_ternarylogic_epi32(even, he2, bit5, 0xF8);
            odd = _mm512_ternarylogic_epi32(odd, ho2, bit5, 0xF8);
          }
        }
        for (int i = 0; i < MR; ++i) {
          const int64_t o = (m0 + i) * words + j;
          ah[i] = _mm512_dpbusd_epi32(ah[i], even, _mm512_set1_epi32(static_cast<int32_t>(xp.hi_even[o])));
          ah[i] = _mm512_dpbusd_epi32(ah[i], odd, _mm512_set1_epi32(static_cast<int32_t>(xp.hi_odd[o])));
          al[i] = _mm512_dpbusd_epi32(al[i], even, _mm512_set1_epi32(static_cast<int32_t>(xp.lo_even[o])));
          al[i] = _mm512_dpbusd_epi32(al[i], odd, _mm512_set1_epi32(static_cast<int32_t>(xp.lo_odd[o])));
        }
      } else {
        for (int i = 0; i < MR; ++i) {
          const int64_t o = (m0 + i) * words + j;
          ah[i] = _mm512_dpbusd_epi32(ah[i], w, _mm512_set1_epi32(static_cast<int32_t>(xp.hi_even[o])));
          al[i] = _mm512_dpbusd_epi32(al[i], w, _mm512_set1_epi32(static_cast<int32_t>(xp.lo_even[o])));
        }
      }
    }
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(smb + g * sms)));
    // a stored min, or (symmetric codes: sm holds scales alone) min_mult x scale, exact for GGUF's types
    const __m512 minv = sms == 32 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(smb + g * 32 + 16)))
                                  : _mm512_mul_ps(scale, _mm512_set1_ps(min_mult));
    for (int i = 0; i < MR; ++i) {
      // sum_k x q / s_x, then w's scale and min
      const __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(al[i]), _mm512_set1_ps(1.f / 256.f), _mm512_cvtepi32_ps(ah[i]));
      const int64_t o = (m0 + i) * groups + g;
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(xp.scale[o])), dot, acc[i]);
      acc[i] = _mm512_fmadd_ps(minv, _mm512_set1_ps(xp.sum[o]), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(rows_out + 16 * i, acc[i]);
}

template <int BITS, typename X, typename R>
void qv_rows(const XParts& xp, const int32_t* codes, const int32_t* hbits, const Half* sm, X* y, const R* res, R* out,
             int64_t m_rows, int64_t n, int64_t k, int64_t group, int64_t sms, float min_mult) {
  const int64_t per_word = BITS == 8 ? 4 : 8;
  const int64_t blocks = (n + 15) / 16, words = k / per_word, groups = k / group, wpg = group / per_word;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float rows[4 * 16];
    for (int64_t b = b0; b < b1; ++b) {
      const int32_t* blk = codes + b * words * 16;
      const int32_t* hb = hbits == nullptr ? nullptr : hbits + b * (k / 32) * 16 * (BITS == 6 ? 2 : 1);
      const Half* smb = sm + b * groups * sms;
      const int64_t valid = std::min<int64_t>(16, n - b * 16);
      for (int64_t m0 = 0; m0 < m_rows;) {
        const int64_t left = m_rows - m0;
        const int mr = left >= 4 ? 4 : left >= 2 ? 2 : 1;
        if (mr == 4) qv_block<BITS, 4>(xp, blk, hb, smb, m0, words, groups, wpg, sms, min_mult, rows);
        else if (mr == 2) qv_block<BITS, 2>(xp, blk, hb, smb, m0, words, groups, wpg, sms, min_mult, rows);
        else qv_block<BITS, 1>(xp, blk, hb, smb, m0, words, groups, wpg, sms, min_mult, rows);
        for (int i = 0; i < mr; ++i) {
          const int64_t base = (m0 + i) * n + b * 16;
          for (int64_t r = 0; r < valid; ++r) {
            const X rounded = from_f<X>(rows[16 * i + r]);
            if (out != nullptr) {
              out[base + r] = from_f<R>(to_f(res[base + r]) + to_f(rounded));
            } else {
              y[base + r] = rounded;
            }
          }
        }
        m0 += mr;
      }
    }
  });
}
#endif

bool qv_supported() {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

// x [M, K] @ W^T with W in the q4v (bits 4), q5v (bits 5: q4v codes of the low four bits and
// `hbits` int32 [ceil(N / 16), K / 32, 16], the fifth bit of column 32 c + 8 t + 2 i + p at bit
// 8 i + 2 t + p of lane r's word c), q6v (bits 6: hbits [ceil(N / 16), K / 32, 2, 16], plane 0 the
// fifth bits, plane 1 the sixth, each placed as q5v's) or q8v (bits 8) layout: see the comment
// above XParts.
at::Tensor qv_gemm(const at::Tensor& x, const at::Tensor& codes, const c10::optional<at::Tensor>& hbits,
                   const at::Tensor& sm, int64_t group, int64_t n, int64_t bits,
                   const c10::optional<at::Tensor>& residual, double min_mult) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  check_cpu(x, "x");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "qv_gemm: 4-, 5-, 6- or 8-bit codes");
  TORCH_CHECK(x.dim() == 2, "qv_gemm: x [M, K]");
  const int64_t m = x.size(0), k = x.size(1), blocks = (n + 15) / 16, per_word = bits == 8 ? 4 : 8;
  const bool high = bits == 5 || bits == 6;
  TORCH_CHECK(high == hbits.has_value(), "qv_gemm: 5- and 6-bit codes come with their high bits, others without");
  if (high) {
    TORCH_CHECK(k % 32 == 0 && hbits->scalar_type() == at::kInt && hbits->is_contiguous() &&
                    hbits->numel() == blocks * (k / 32) * 16 * (bits - 4),
                "qv_gemm: int32 high bits [ceil(N / 16), K / 32, (planes,) 16]");
  }
  TORCH_CHECK(group > 0 && group % per_word == 0 && k % group == 0,
              "qv_gemm: groups of a multiple of ", per_word, " columns tiling K");
  TORCH_CHECK(codes.scalar_type() == at::kInt && codes.is_contiguous() && codes.numel() == blocks * (k / per_word) * 16,
              "qv_gemm: int32 codes [ceil(N / 16), K / ", per_word, ", 16]");
  // sm: (scale, min) per group, or scales alone (symmetric codes: min = min_mult x scale)
  const int64_t sms = sm.numel() == blocks * (k / group) * 16 ? 16 : 32;
  TORCH_CHECK(sm.scalar_type() == at::kHalf && sm.is_contiguous() && sm.numel() == blocks * (k / group) * sms,
              "qv_gemm: fp16 scales and mins [ceil(N / 16), K / G, 2, 16] (or scales alone [.., 1, 16])");
  thread_local XParts xp;  // reused: its buffers grow to the largest call and stay
  bool done = false;
#if defined(__BMI2__)
  if (group % 16 == 0 && x.is_contiguous()) {
    KVT_DISPATCH_FLOAT(x.scalar_type(), "qv_gemm", [&] { x_parts_vec<scalar_t>(x.data_ptr<scalar_t>(), m, k, group, bits != 8, xp); });
    done = true;
  }
#endif
  if (!done) {
    auto xf = x.to(at::kFloat).contiguous();
    xp = x_parts(xf.data_ptr<float>(), m, k, group, bits != 8);
  }
  const int32_t* cp = codes.data_ptr<int32_t>();
  const int32_t* hp = high ? hbits->data_ptr<int32_t>() : nullptr;
  const Half* sp = sm.data_ptr<Half>();
  auto run = [&](auto bits_tag, auto* y, const auto* res, auto* out) {
    constexpr int B = decltype(bits_tag)::value;
    using X = std::remove_pointer_t<decltype(y)>;
    using R = std::remove_const_t<std::remove_pointer_t<decltype(res)>>;
    qv_rows<B, X, R>(xp, cp, hp, sp, y, res, out, m, n, k, group, sms, static_cast<float>(min_mult));
  };
  auto dispatch_bits = [&](auto* y, const auto* res, auto* out) {
    if (bits == 4) run(std::integral_constant<int, 4>{}, y, res, out);
    else if (bits == 5) run(std::integral_constant<int, 5>{}, y, res, out);
    else if (bits == 6) run(std::integral_constant<int, 6>{}, y, res, out);
    else run(std::integral_constant<int, 8>{}, y, res, out);
  };
  if (residual.has_value()) {
    const at::Tensor& res = *residual;
    TORCH_CHECK(res.dim() == 2 && res.size(0) == m && res.size(1) == n, "qv_gemm: residual [M, N]");
    auto rc = res.contiguous();
    auto out = at::empty_like(rc);
    KVT_DISPATCH_FLOAT(x.scalar_type(), "qv_gemm", [&] {
      using X = scalar_t;
      KVT_DISPATCH_FLOAT(rc.scalar_type(), "qv_gemm", [&] {
        dispatch_bits(static_cast<X*>(nullptr), rc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>());
      });
    });
    return out;
  }
  auto y = at::empty({m, n}, x.options());
  KVT_DISPATCH_FLOAT(x.scalar_type(), "qv_gemm", [&] {
    dispatch_bits(y.data_ptr<scalar_t>(), static_cast<const float*>(nullptr), static_cast<float*>(nullptr));
  });
  return y;
#else
  TORCH_CHECK(false, "qv_gemm: built without AVX512-VNNI");
#endif
}

// Rows r0 .. r0 + R - 1 of a q4v / q5v / q6v / q8v weight (the qv_gemm layouts) dequantized into
// out [R, K] (fp32 / bf16 / fp16): w = u scale + min (min = min_mult x scale for symmetric codes), the
// product and the sum each rounded in fp32, then one rounding to out's dtype, as VNNIWeight._unpack
// computes it (torch's addcmul). Prefill dequantizes a layer's weights into a reused scratch this
// way before a dense GEMM; the PyTorch unpack took ~30x the GEMM's time (int64 shifts of every code).
void qv_dequant(const at::Tensor& codes, const c10::optional<at::Tensor>& hbits, const at::Tensor& sm,
                int64_t group, int64_t bits, double min_mult, int64_t r0, at::Tensor& out) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "qv_dequant: 4-, 5-, 6- or 8-bit codes");
  check_cpu(out, "out");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous(), "qv_dequant: out [R, K], contiguous");
  const int64_t rows = out.size(0), k = out.size(1), per_word = bits == 8 ? 4 : 8, width = 32 / per_word;
  const int64_t words = k / per_word, groups = k / group, planes = (bits == 5 || bits == 6) ? bits - 4 : 0;
  TORCH_CHECK(group > 0 && k % group == 0 && group % per_word == 0, "qv_dequant: groups tiling K");
  TORCH_CHECK(codes.scalar_type() == at::kInt && codes.is_contiguous() && codes.dim() == 3 &&
                  codes.size(1) == words && codes.size(2) == 16 && r0 >= 0 && (r0 + rows + 15) / 16 <= codes.size(0),
              "qv_dequant: int32 codes [ceil(N / 16), K / ", per_word, ", 16] holding the rows");
  TORCH_CHECK(planes == 0 || (hbits.has_value() && hbits->scalar_type() == at::kInt && hbits->is_contiguous() &&
                              hbits->numel() == codes.size(0) * (k / 32) * planes * 16),
              "qv_dequant: 5- and 6-bit codes come with int32 high bits [ceil(N / 16), K / 32, planes, 16]");
  const int64_t sms = sm.numel() == codes.size(0) * groups * 16 ? 1 : 2;  // scales alone, or (scale, min)
  TORCH_CHECK(sm.scalar_type() == at::kHalf && sm.is_contiguous() && sm.numel() == codes.size(0) * groups * 16 * sms,
              "qv_dequant: fp16 scales (and mins) [ceil(N / 16), K / G, 1 or 2, 16]");
  const int32_t* cp = codes.data_ptr<int32_t>();
  const int32_t* hp = planes ? hbits->data_ptr<int32_t>() : nullptr;
  const Half* sp = sm.data_ptr<Half>();
  const float mm = static_cast<float>(min_mult);
  const uint32_t mask = (1u << width) - 1;
  // bit of column 32 c + cc in a high-bits word: cc = 8 t + 2 i + p sits at bit 8 i + 2 t + p
  int hbit[32];
  for (int cc = 0; cc < 32; ++cc) hbit[cc] = 8 * ((cc % 8) / 2) + 2 * (cc / 8) + (cc % 2);
  KVT_DISPATCH_FLOAT(out.scalar_type(), "qv_dequant", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
      std::vector<float> u(k);
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t row = r0 + i, b = row / 16, lane = row % 16;
        for (int64_t j = 0; j < words; ++j) {
          const uint32_t w = static_cast<uint32_t>(cp[(b * words + j) * 16 + lane]);
          for (int64_t t = 0; t < per_word; ++t) u[j * per_word + t] = static_cast<float>((w >> (width * t)) & mask);
        }
        for (int64_t plane = 0; plane < planes; ++plane) {
          for (int64_t c = 0; c < k / 32; ++c) {
            const uint32_t h = static_cast<uint32_t>(hp[((b * (k / 32) + c) * planes + plane) * 16 + lane]);
            for (int cc = 0; cc < 32; ++cc) u[c * 32 + cc] += static_cast<float>(((h >> hbit[cc]) & 1u) << (4 + plane));
          }
        }
        scalar_t* orow = op + i * k;
        for (int64_t g = 0; g < groups; ++g) {
          const float scale = static_cast<float>(sp[((b * groups + g) * sms) * 16 + lane]);
          const float minv = sms == 2 ? static_cast<float>(sp[((b * groups + g) * 2 + 1) * 16 + lane]) : scale * mm;
          for (int64_t c = g * group; c < (g + 1) * group; ++c) {
            const float prod = u[c] * scale;
            orow[c] = from_f<scalar_t>(minv + prod);
          }
        }
      }
    });
  });
}

// Rows of codes (uint8 [R, K], each < 2^bits) into the qv layouts qv_gemm reads (VNNIWeight's
// buffers, from block 0 of `out`: R <= 16 x its blocks, rows past R zero): out int32 [Nb, K / W, 16]
// with lane r of word (b, j) holding row 16 b + r, columns W j .. W j + W - 1 at bits B i (B = 32 /
// W: 4-bit words of eight, 8-bit words of four); 5- and 6-bit codes put their low four bits there and
// bit 4 + plane of column 32 c + 8 t + 2 i + p at bit 8 i + 2 t + p of hbits [Nb, K / 32, planes,
// 16] lane r, word c. The same words as VNNIWeight._pack_rows builds with int64 shifts and sums
// per 64 rows in PyTorch (~20 of a 0.5B GGUF's ~30 s load).
void qv_pack(const at::Tensor& codes, int64_t bits, at::Tensor& out, const c10::optional<at::Tensor>& hbits) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "qv_pack: 4-, 5-, 6- or 8-bit codes");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous(),
              "qv_pack: uint8 codes [R, K], contiguous");
  const int64_t r = codes.size(0), k = codes.size(1), per_word = bits == 8 ? 4 : 8, width = 32 / per_word;
  const int64_t words = k / per_word, planes = (bits == 5 || bits == 6) ? bits - 4 : 0;
  TORCH_CHECK(k % (planes ? 32 : per_word) == 0, "qv_pack: K a multiple of the words' columns");
  TORCH_CHECK(out.scalar_type() == at::kInt && out.is_contiguous() && out.dim() == 3 && out.size(1) == words &&
                  out.size(2) == 16 && out.size(0) * 16 >= r,
              "qv_pack: int32 out [Nb, K / ", per_word, ", 16] holding the rows");
  const int64_t nb = out.size(0);
  TORCH_CHECK(planes == 0 || (hbits.has_value() && hbits->scalar_type() == at::kInt && hbits->is_contiguous() &&
                              hbits->numel() == nb * (k / 32) * planes * 16),
              "qv_pack: 5- and 6-bit codes need int32 hbits [Nb, K / 32, planes, 16]");
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  int32_t* op = out.data_ptr<int32_t>();
  int32_t* hp = planes ? hbits->data_ptr<int32_t>() : nullptr;
  const uint32_t low = planes ? 0xFu : (1u << width) - 1;
  int hbit[32];
  for (int cc = 0; cc < 32; ++cc) hbit[cc] = 8 * ((cc % 8) / 2) + 2 * (cc / 8) + (cc % 2);
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t lane = 0; lane < 16; ++lane) {
        const int64_t row = b * 16 + lane;
        const uint8_t* c = row < r ? cp + row * k : nullptr;
        for (int64_t j = 0; j < words; ++j) {
          uint32_t w = 0;
          if (c != nullptr)
            for (int64_t i = 0; i < per_word; ++i) w |= (static_cast<uint32_t>(c[j * per_word + i]) & low) << (width * i);
          op[(b * words + j) * 16 + lane] = static_cast<int32_t>(w);
        }
        for (int64_t plane = 0; plane < planes; ++plane) {
          for (int64_t cw = 0; cw < k / 32; ++cw) {
            uint32_t w = 0;
            if (c != nullptr)
              for (int cc = 0; cc < 32; ++cc) w |= ((static_cast<uint32_t>(c[cw * 32 + cc]) >> (4 + plane)) & 1u) << hbit[cc];
            hp[((b * (k / 32) + cw) * planes + plane) * 16 + lane] = static_cast<int32_t>(w);
          }
        }
      }
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the kernels run without the GIL, as torch's own ops do: the server's event loop (another
  // Python thread) streams tokens while a step computes
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm of fp32 rows, cast to out_dtype");
  m.def("rope_", &rope_, nogil, "per-head RMSNorm (optional) + rotary, in place on qkv");
  m.def("kv_store", &kv_store, nogil, "K/V rows into a plain page pool layer");
  m.def("paged_decode", &paged_decode, nogil, "one-row-per-sequence attention over paged K/V");
  m.def("paged_decode_lists", &paged_decode_lists, nogil, "decode attention over each kv head's own page list");
  m.def("quest_scores", &quest_scores, nogil, "Quest bounds of candidate pages per row and kv head");
  m.def("silu_mul", &silu_mul, nogil, "silu(gu[:, :I]) * gu[:, I:]");
  m.def("qv_gemm", &qv_gemm, nogil, "x @ W^T over 4-bit q4v / 5-bit q5v / 6-bit q6v / 8-bit q8v codes (AVX512-VNNI) (+ residual)");
  m.def("qv_dequant", &qv_dequant, nogil, "rows of a q4v / q5v / q6v / q8v weight, dequantized into out");
  m.def("qv_pack", &qv_pack, nogil, "uint8 codes [R, K] into the q4v / q5v / q6v / q8v words (and high bits)");
  m.def("qv_supported", &qv_supported, "whether qv_gemm was built (AVX512-VNNI)");
}
