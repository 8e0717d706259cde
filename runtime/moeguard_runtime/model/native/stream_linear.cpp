// moeguard's weight-streaming expert matmul for a few rows (decode), x86-64 with AVX2 and FMA.
//
// y[r, o] = sum_k x[r, k] * w[o, k] for r < n, o < out: the product F.linear computes, x @ w.T.
// At a few rows an expert call is a pass over its weights (about 0.5 flop per byte), so the kernel is
// built to stream w once at the memory's read rate: each pass loads 4 weight rows and multiplies them
// with 3 rows of x held in the L1 cache (12 accumulators of 8 lanes, the 16 ymm registers' budget), and
// more rows of x re-read a block of 96 KiB of weight rows from the L2 cache. Weights are float32 or
// bfloat16 (widened in registers: a bfloat16 is the high half of a float32); x and y are float32, rows
// apart by ldx and ldy floats. The output rows are split over `threads` OpenMP threads (torch's own runtime: this
// library needs libgomp.so.1, which torch has loaded).
//
// Built by moeguard_runtime.model.stream_kernel (g++ -O3 -mavx2 -mfma -fopenmp -shared), loaded with
// ctypes, and only called on a CPU that reports avx2 and fma. Tested against F.linear
// (tests/unit/runtime/test_stream_kernel.py).
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

#include <vector>

namespace {

constexpr int P = 4;                      // weight rows per pass
constexpr int R = 3;                      // rows of x per pass (4 x 3 accumulators: 12 of the 16 ymm registers)
constexpr int64_t BLOCK_BYTES = 96 << 10;  // weight rows per block: re-read from L2 by each group of R rows of x

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

// Bfloat16 weights: 16 weights of a row per 256-bit load, widened without a shuffle: as 8 int32 lanes, each
// lane's high half is the odd weight (mask the low half off) and its low half the even one (shift it up). x
// comes deinterleaved to match (xd: per 16 values, the 8 even ones, then the 8 odd ones; the tail of in % 16
// values in order).
template <int RR>
void block_bf16(const float *xd, int64_t ldx, int in, const uint16_t *w, int o0, int o1, float *y, int64_t ldy) {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    int o = o0;
    for (; o + P <= o1; o += P) {
        const uint16_t *wp[P];
        for (int p = 0; p < P; p++) wp[p] = w + static_cast<int64_t>(o + p) * in;
        __m256 acc[RR][P];
        for (int r = 0; r < RR; r++)
            for (int p = 0; p < P; p++) acc[r][p] = _mm256_setzero_ps();
        int k = 0;
        for (; k + 16 <= in; k += 16) {
            for (int p = 0; p < P; p++) {
                __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(wp[p] + k));
                __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                for (int r = 0; r < RR; r++) {
                    acc[r][p] = _mm256_fmadd_ps(even, _mm256_loadu_ps(xd + r * ldx + k), acc[r][p]);
                    acc[r][p] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xd + r * ldx + k + 8), acc[r][p]);
                }
            }
        }
        for (int r = 0; r < RR; r++)
            for (int p = 0; p < P; p++) {
                float s = hsum(acc[r][p]);
                for (int kk = k; kk < in; kk++) s += widen(wp[p][kk]) * xd[r * ldx + kk];
                y[r * ldy + o + p] = s;
            }
    }
    const int full = in / 16 * 16;
    for (; o < o1; o++)
        for (int r = 0; r < RR; r++) {
            const uint16_t *w0 = w + static_cast<int64_t>(o) * in;
            float s = 0.0f;
            for (int kk = 0; kk < full; kk++) {  // xd's order: even values at c + j, odd ones at c + 8 + j
                int c = kk / 16 * 16, j = kk % 16;
                s += widen(w0[kk]) * xd[r * ldx + c + (j % 2) * 8 + j / 2];
            }
            for (int kk = full; kk < in; kk++) s += widen(w0[kk]) * xd[r * ldx + kk];
            y[r * ldy + o] = s;
        }
}

template <typename W>
void rows(const float *x, int64_t ldx, int n, int in, const W *w, int o0, int o1, float *y, int64_t ldy) {
    if constexpr (sizeof(W) == 4) {
        if (n == 1) block_f32<1>(x, ldx, in, w, o0, o1, y, ldy);
        else if (n == 2) block_f32<2>(x, ldx, in, w, o0, o1, y, ldy);
        else block_f32<R>(x, ldx, in, w, o0, o1, y, ldy);
    } else {
        if (n == 1) block_bf16<1>(x, ldx, in, w, o0, o1, y, ldy);
        else if (n == 2) block_bf16<2>(x, ldx, in, w, o0, o1, y, ldy);
        else block_bf16<R>(x, ldx, in, w, o0, o1, y, ldy);
    }
}

template <typename W>
void linear(const float *x, int64_t ldx, int n, int in, const W *w, int out, float *y, int64_t ldy, int threads) {
    int64_t row_bytes = static_cast<int64_t>(in) * static_cast<int64_t>(sizeof(W));
    int block = static_cast<int>(BLOCK_BYTES / row_bytes) / P * P;
    if (block < P) block = P;
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int share = ((out + nt - 1) / nt + P - 1) / P * P;
        int o0 = t * share, o1 = o0 + share < out ? o0 + share : out;
        for (int b0 = o0; b0 < o1; b0 += block) {
            int b1 = b0 + block < o1 ? b0 + block : o1;
            for (int r = 0; r < n; r += R) {
                int rr = n - r < R ? n - r : R;
                rows(x + r * ldx, ldx, rr, in, w, b0, b1, y + r * ldy, ldy);
            }
        }
    }
}

// x's rows deinterleaved for block_bf16: per 16 values the 8 even ones then the 8 odd ones.
std::vector<float> deinterleave(const float *x, int64_t ldx, int n, int in) {
    std::vector<float> xd(static_cast<size_t>(n) * static_cast<size_t>(in));
    const int full = in / 16 * 16;
    for (int r = 0; r < n; r++) {
        const float *src = x + r * ldx;
        float *dst = xd.data() + static_cast<int64_t>(r) * in;
        for (int c = 0; c < full; c += 16)
            for (int j = 0; j < 8; j++) {
                dst[c + j] = src[c + 2 * j];
                dst[c + 8 + j] = src[c + 2 * j + 1];
            }
        for (int k = full; k < in; k++) dst[k] = src[k];
    }
    return xd;
}

}  // namespace

extern "C" {

// The library's interface version: stream_kernel.py refuses a library of another version.
int moeguard_stream_version() { return 1; }

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
    std::vector<float> xd = deinterleave(x, ldx, n, in);
    linear(xd.data(), static_cast<int64_t>(in), n, in, w, out, y, ldy, threads);
}

}
