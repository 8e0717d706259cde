// moeguard's weight-streaming expert matmul for a few rows (decode), x86-64 with AVX2 and FMA.
//
// y[r, o] = sum_k x[r, k] * w[o, k] for r < n, o < out: the product F.linear computes, x @ w.T.
// At a few rows an expert call is a pass over its weights (about 0.5 flop per byte), so the kernel is
// built to stream w once at the memory's read rate: each pass loads 4 weight rows and multiplies them
// with 3 rows of x held in the L1 cache (12 accumulators of 8 lanes, the 16 ymm registers' budget; with
// bfloat16 weights 3 weight rows and 4 rows of x, the next 3 rows prefetched), and more rows of x re-read a
// block of 96 KiB of weight rows from the L2 cache. Weights are float32 or bfloat16 (widened in registers: a
// bfloat16 is the high half of a float32); x and y are float32, rows apart by ldx and ldy floats. The output
// rows are split over `threads` OpenMP threads (torch's own runtime: this library needs libgomp.so.1, which
// torch has loaded).
//
// The routed experts of one MoE layer at a few token-slots (decode) run in one call as well
// (moeguard_stream_experts_*): for each expert with slots, its rows of x gathered, h = rows @ w13[e].T
// ([n, 2I], the gate projection's rows then the up projection's), g = silu(h[:, :I]) * h[:, I:] (SwiGLU:
// Shazeer 2020, "GLU Variants Improve Transformer"), y = g @ w2[e].T ([n, D]), out[token] += weight * y,
// in one OpenMP parallel region: the threads split I (each computes its gate rows and the matching up
// rows, so it activates its own columns without waiting) and then D (each adds its own columns of y into
// out, so no two threads write one value), with a barrier between the phases and none of the per-expert
// Python work (index_select, two library calls, silu, mul, the weighting, index_add_) of the dispatch.
//
// Built by moeguard_runtime.model.stream_kernel (g++ -O3 -mavx2 -mfma -fopenmp -shared), loaded with
// ctypes, and only called on a CPU that reports avx2 and fma. Tested against F.linear and against the
// dispatch's per-expert loop (tests/unit/runtime/test_stream_kernel.py, test_stream_experts.py).
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <new>

namespace {

constexpr int P = 4;                      // weight rows per pass
constexpr int R = 3;                      // rows of x per pass (4 x 3 accumulators: 12 of the 16 ymm registers)
constexpr int RB = 4;                     // rows of x per pass with bfloat16 weights (4 x 3 accumulators)
constexpr int64_t BLOCK_BYTES = 96 << 10;  // weight rows per block: re-read from L2 by each pass's rows of x

inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}

inline float widen(uint16_t b) {
    union { uint32_t u; float f; } v;
    v.u = static_cast<uint32_t>(b) << 16;
    return v.f;
}

// Float32 weights: 8 weights of each of the P rows per step, against 8 values of each row of x.
template <int RR>
void block_f32(const float *x, int64_t ldx, int in, const float *w, int o0, int o1, float *y, int64_t ldy) {
    int o = o0;
    for (; o + P <= o1; o += P) {
        const float *wp[P];
        for (int p = 0; p < P; p++) wp[p] = w + static_cast<int64_t>(o + p) * in;
        __m256 acc[RR][P];
        for (int r = 0; r < RR; r++)
            for (int p = 0; p < P; p++) acc[r][p] = _mm256_setzero_ps();
        int k = 0;
        for (; k + 8 <= in; k += 8) {
            __m256 v[P];
            for (int p = 0; p < P; p++) v[p] = _mm256_loadu_ps(wp[p] + k);
            for (int r = 0; r < RR; r++) {
                __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
                for (int p = 0; p < P; p++) acc[r][p] = _mm256_fmadd_ps(v[p], xv, acc[r][p]);
            }
        }
        for (int r = 0; r < RR; r++)
            for (int p = 0; p < P; p++) {
                float s = hsum(acc[r][p]);
                for (int kk = k; kk < in; kk++) s += wp[p][kk] * x[r * ldx + kk];
                y[r * ldy + o + p] = s;
            }
    }
    for (; o < o1; o++)
        for (int r = 0; r < RR; r++) {
            float s = 0.0f;
            for (int kk = 0; kk < in; kk++) s += w[static_cast<int64_t>(o) * in + kk] * x[r * ldx + kk];
            y[r * ldy + o] = s;
        }
}

// Bfloat16 weights: 8 weights of each of PP rows per step, widened in registers (vpmovzxwd, then a shift: a
// bfloat16 is the high half of a float32), each widened vector used against all RR rows of x (each row's 8 values
// loaded once per step: an empty asm keeps the compiler from folding a load of it into each of the PP FMAs, which
// left the loads, not the FMAs, bounding the loop): RR x PP accumulators, PP widened weights and one row of x in the
// 16 ymm registers. The next group of PP rows is prefetched into L2 as the current one streams (a cache line per row
// every 32 weights): at a few rows the hardware prefetcher alone left the weights' reads and the arithmetic one
// after the other. Measured on the AMD EPYC of 2026-12-07 (D=1024, I=2816, both matmuls of 8 experts in turn, 2
// threads, medians of 25 interleaved rounds), per expert at 4 rows of x: 1.43 ms before this form (even/odd
// widening, x folded), 1.35 ms with the prefetch, 1.14 ms with x loaded once too, 1.10 ms with blocks and thread
// shares of whole groups (ALIGN); at 16 rows 4.6, 3.5 and 3.3 ms. Issue 31.
inline __m256 widen8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int RR, int PP>
int group_bf16(const float *x, int64_t ldx, int in, const uint16_t *w, int o0, int o1, float *y, int64_t ldy) {
    int o = o0;
    for (; o + PP <= o1; o += PP) {
        const uint16_t *wp[PP];
        for (int p = 0; p < PP; p++) wp[p] = w + static_cast<int64_t>(o + p) * in;
        const int64_t ahead = static_cast<int64_t>(PP) * in;  // the next group's rows
        __m256 acc[RR][PP];
        for (int r = 0; r < RR; r++)
            for (int p = 0; p < PP; p++) acc[r][p] = _mm256_setzero_ps();
        int k = 0;
        for (; k + 8 <= in; k += 8) {
            if ((k & 31) == 0)
                for (int p = 0; p < PP; p++)
                    _mm_prefetch(reinterpret_cast<const char *>(wp[p] + ahead + k), _MM_HINT_T1);
            __m256 v[PP];
            for (int p = 0; p < PP; p++) v[p] = widen8(wp[p] + k);
            for (int r = 0; r < RR; r++) {
                __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
                __asm__("" : "+x"(xv));  // one load of x per row and step, not one folded into each of PP FMAs
                for (int p = 0; p < PP; p++) acc[r][p] = _mm256_fmadd_ps(v[p], xv, acc[r][p]);
            }
        }
        for (int r = 0; r < RR; r++)
            for (int p = 0; p < PP; p++) {
                float s = hsum(acc[r][p]);
                for (int kk = k; kk < in; kk++) s += widen(wp[p][kk]) * x[r * ldx + kk];
                y[r * ldy + o + p] = s;
            }
    }
    return o;
}

// Rows [o0, o1) for RR rows of x: groups of PP weight rows, the rest one row at a time.
template <int RR, int PP>
void block_bf16(const float *x, int64_t ldx, int in, const uint16_t *w, int o0, int o1, float *y, int64_t ldy) {
    int o = group_bf16<RR, PP>(x, ldx, in, w, o0, o1, y, ldy);
    if (o < o1) group_bf16<RR, 1>(x, ldx, in, w, o, o1, y, ldy);
}

template <typename W>
void rows(const float *x, int64_t ldx, int n, int in, const W *w, int o0, int o1, float *y, int64_t ldy) {
    if constexpr (sizeof(W) == 4) {
        if (n == 1) block_f32<1>(x, ldx, in, w, o0, o1, y, ldy);
        else if (n == 2) block_f32<2>(x, ldx, in, w, o0, o1, y, ldy);
        else block_f32<R>(x, ldx, in, w, o0, o1, y, ldy);
    } else {  // rows of x x weight rows per group: as many accumulators as the registers hold
        if (n == 1) block_bf16<1, 6>(x, ldx, in, w, o0, o1, y, ldy);
        else if (n == 2) block_bf16<2, 4>(x, ldx, in, w, o0, o1, y, ldy);
        else if (n == 3) block_bf16<3, 3>(x, ldx, in, w, o0, o1, y, ldy);
        else block_bf16<RB, 3>(x, ldx, in, w, o0, o1, y, ldy);
    }
}

// Weight rows that a block and a thread's share are a multiple of: a whole number of the groups that W's passes
// take (float32: P; bfloat16: 3, 4 and 6, block_bf16's), so no row of a block but the matrix's last falls to the
// one-row remainder.
template <typename W>
constexpr int ALIGN = sizeof(W) == 4 ? P : 12;

// Weight rows per L2 block for rows of `in` weights of type W (a multiple of ALIGN<W>).
template <typename W>
int block_rows(int in) {
    int64_t row_bytes = static_cast<int64_t>(in) * static_cast<int64_t>(sizeof(W));
    int block = static_cast<int>(BLOCK_BYTES / (row_bytes > 0 ? row_bytes : 1)) / ALIGN<W> * ALIGN<W>;
    return block < ALIGN<W> ? ALIGN<W> : block;
}

// y[r, o] for o in [o0, o1), every r < n: block by block, R (bfloat16: RB) rows of x at a time (one thread's
// share).
template <typename W>
void span(const float *x, int64_t ldx, int n, int in, const W *w, int o0, int o1, float *y, int64_t ldy,
          int block) {
    for (int b0 = o0; b0 < o1; b0 += block) {
        int b1 = b0 + block < o1 ? b0 + block : o1;
        constexpr int step = sizeof(W) == 4 ? R : RB;
        for (int r = 0; r < n; r += step) {
            int rr = n - r < step ? n - r : step;
            rows(x + r * ldx, ldx, rr, in, w, b0, b1, y + r * ldy, ldy);
        }
    }
}

// [o0, o1) of `count` items split over nt threads in shares of a multiple of `align` (thread t's share).
inline void share_of(int count, int align, int t, int nt, int &o0, int &o1) {
    int share = ((count + nt - 1) / nt + align - 1) / align * align;
    int64_t a = static_cast<int64_t>(t) * share, b = a + share;
    o0 = static_cast<int>(a < count ? a : count);
    o1 = static_cast<int>(b < count ? b : count);
}

template <typename W>
void linear(const float *x, int64_t ldx, int n, int in, const W *w, int out, float *y, int64_t ldy, int threads) {
    const int block = block_rows<W>(in);
#pragma omp parallel num_threads(threads)
    {
        int o0, o1;
        share_of(out, ALIGN<W>, omp_get_thread_num(), omp_get_num_threads(), o0, o1);
        span(x, ldx, n, in, w, o0, o1, y, ldy, block);
    }
}

// exp(x) for 8 floats: Cephes' expf (S. Moshier), as in avx_mathfun: x = n ln2 + r (ln2 in two parts, |r| <=
// ln2 / 2), e^r by a degree-7 polynomial, times 2^n built in the exponent bits. x is clamped to
// [-88.376, 88.376]: e^x is 0 at the low end (e^-88.38 is a float32 subnormal) and 2.4e38 at the high one
// (no inf). Measured against float64 over [-88, 88] at 16 million points: e^x within 1.01 float32 ulps,
// silu(v) = v / (1 + e^-v) within 2.4 (tests/unit/runtime/test_stream_experts.py checks silu against float64);
// below -88.38 silu is v / 2.4e38 (|v| * 4e-39 off the true value, about 0); a NaN stays a NaN through v.
inline __m256 exp8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, z, x);
    y = _mm256_add_ps(y, one);
    __m256i n = _mm256_cvttps_epi32(fx);
    __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

// silu(v) * u = v / (1 + e^-v) * u, the formula of torch's silu; the tail of a row uses libm's expf.
inline __m256 swiglu8(__m256 v, __m256 u) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), v));
    return _mm256_mul_ps(_mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

inline float swiglu1(float v, float u) { return v / (1.0f + std::exp(-v)) * u; }

// Columns [a, b) of g = silu(h[:, :inter]) * h[:, inter:], written over the gate half of h (row stride
// 2 inter).
void activate(float *h, int n, int inter, int a, int b) {
    const int64_t ldh = 2 * static_cast<int64_t>(inter);
    for (int r = 0; r < n; r++) {
        float *g = h + r * ldh;
        const float *u = g + inter;
        int i = a;
        for (; i + 8 <= b; i += 8) _mm256_storeu_ps(g + i, swiglu8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
        for (; i < b; i++) g[i] = swiglu1(g[i], u[i]);
    }
}

// One layer's routed experts (the exported moeguard_stream_experts_* below); 0, or an error code.
template <typename W>
int experts_call(const float *x, int64_t ldx, int tokens, int dim, int inter, int experts, const int64_t *bounds,
                 const int64_t *slot_token, const float *slot_weight, const W *w13, int64_t w13_stride, const W *w2,
                 int64_t w2_stride, float *out, int64_t ldo, int threads) {
    if (tokens < 0 || dim < 0 || inter < 0 || experts < 0 || bounds[0] != 0) return 1;
    int64_t most = 0;
    for (int e = 0; e < experts; e++) {
        int64_t n = bounds[e + 1] - bounds[e];
        if (n < 0) return 1;
        most = n > most ? n : most;
    }
    const int64_t slots = bounds[experts];
    for (int64_t s = 0; s < slots; s++)
        if (slot_token[s] < 0 || slot_token[s] >= tokens) return 2;
    if (slots == 0 || dim == 0) return 0;
    // The workspace: every slot's row of x [S, D], then h [n, 2I] and y [n, D] of the busiest expert.
    const int64_t xs_len = slots * dim, h_len = most * 2 * static_cast<int64_t>(inter);
    std::unique_ptr<float[]> work(new (std::nothrow) float[xs_len + h_len + most * dim]);
    if (!work) return 3;
    float *xs = work.get(), *h = xs + xs_len, *y = h + h_len;
    const int64_t ldh = 2 * static_cast<int64_t>(inter);
    const int block13 = block_rows<W>(dim), block2 = block_rows<W>(inter);
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int a, b, o0, o1;
        share_of(inter, ALIGN<W>, t, nt, a, b);  // this thread's gate rows [a, b) and up rows [inter + a, inter + b)
        share_of(dim, ALIGN<W>, t, nt, o0, o1);  // and output columns [o0, o1)
        for (int64_t s = static_cast<int64_t>(t) * slots / nt; s < (t + 1) * slots / nt; s++)
            std::memcpy(xs + s * dim, x + slot_token[s] * ldx, static_cast<size_t>(dim) * sizeof(float));
#pragma omp barrier
        for (int e = 0; e < experts; e++) {
            const int64_t s0 = bounds[e];
            const int n = static_cast<int>(bounds[e + 1] - s0);
            if (n == 0) continue;  // the same on every thread: all meet the same barriers
            const W *w13e = w13 + e * w13_stride, *w2e = w2 + e * w2_stride;
            span(xs + s0 * dim, dim, n, dim, w13e, a, b, h, ldh, block13);
            span(xs + s0 * dim, dim, n, dim, w13e, inter + a, inter + b, h, ldh, block13);
            activate(h, n, inter, a, b);
#pragma omp barrier
            span(h, ldh, n, inter, w2e, o0, o1, y, dim, block2);
            for (int r = 0; r < n; r++) {  // out[token] += weight * y: this thread's columns, slot by slot
                float *o = out + slot_token[s0 + r] * ldo;
                const float wr = slot_weight[s0 + r];
                const float *yr = y + static_cast<int64_t>(r) * dim;
                for (int c = o0; c < o1; c++) o[c] += wr * yr[c];
            }
#pragma omp barrier
        }
    }
    return 0;
}

}  // namespace

extern "C" {

// The library's interface version: stream_kernel.py refuses a library of another version.
int moeguard_stream_version() { return 2; }

// The digest of the source it was built from (stream_kernel.source_digest): a prebuilt library of another
// source is not loaded.
#ifndef MOEGUARD_STREAM_SOURCE
#define MOEGUARD_STREAM_SOURCE "unknown"
#endif
const char *moeguard_stream_source() { return MOEGUARD_STREAM_SOURCE; }

void moeguard_stream_linear_f32(const float *x, int64_t ldx, int n, int in, const float *w, int out, float *y,
                                int64_t ldy, int threads) {
    linear(x, ldx, n, in, w, out, y, ldy, threads);
}

void moeguard_stream_linear_bf16(const float *x, int64_t ldx, int n, int in, const uint16_t *w, int out, float *y,
                                 int64_t ldy, int threads) {
    linear(x, ldx, n, in, w, out, y, ldy, threads);
}

// One MoE layer's routed experts at a few token-slots, in one call and one parallel region:
//   out[slot_token[s], :] += slot_weight[s] * (silu(x_s @ w13[e][:I].T) * (x_s @ w13[e][I:].T)) @ w2[e].T
// for every slot s in [bounds[e], bounds[e + 1]) of every expert e, x_s = x[slot_token[s], :], the experts in
// ascending order (so each token's additions come in the order of an index_add_ over the sorted slots).
// x [tokens, dim] float32 (rows ldx floats apart); bounds [experts + 1] int64, bounds[0] = 0, ascending;
// slot_token [bounds[experts]] int64 in [0, tokens) (a token may repeat: each thread adds its own columns of
// every slot in order, so no two threads write one value and no atomics are needed); slot_weight float32;
// w13 [experts, 2 inter, dim] (expert e at w13 + e * w13_stride elements, rows dense), w2 [experts, dim, inter]
// likewise; out [tokens, dim] float32 (rows ldo floats apart), added into. Workspace allocated here:
// 4 * (S * dim + n * (2 inter + dim)) bytes, S the slots and n the busiest expert's (S = 32, n = 8 at D=1024,
// I=2816: 0.3 MB; S = n = 256: 7.8 MB).
// Returns 0; 1 when bounds or a size is invalid, 2 when a slot's token is out of range (nothing computed for
// either), 3 when the workspace cannot be allocated.
int moeguard_stream_experts_f32(const float *x, int64_t ldx, int tokens, int dim, int inter, int experts,
                                const int64_t *bounds, const int64_t *slot_token, const float *slot_weight,
                                const float *w13, int64_t w13_stride, const float *w2, int64_t w2_stride, float *out,
                                int64_t ldo, int threads) {
    return experts_call(x, ldx, tokens, dim, inter, experts, bounds, slot_token, slot_weight, w13, w13_stride, w2,
                        w2_stride, out, ldo, threads);
}

// The same with bfloat16 weights (widened in registers; x, the arithmetic and out float32).
int moeguard_stream_experts_bf16(const float *x, int64_t ldx, int tokens, int dim, int inter, int experts,
                                 const int64_t *bounds, const int64_t *slot_token, const float *slot_weight,
                                 const uint16_t *w13, int64_t w13_stride, const uint16_t *w2, int64_t w2_stride,
                                 float *out, int64_t ldo, int threads) {
    return experts_call(x, ldx, tokens, dim, inter, experts, bounds, slot_token, slot_weight, w13, w13_stride, w2,
                        w2_stride, out, ldo, threads);
}

}
