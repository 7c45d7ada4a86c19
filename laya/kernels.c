/* The packed bf16 engine's work between its GEMMs, compiled: attention (with rotary), the residual add fused into
   the next layer norm, and small per-row fp32 linears. Built and loaded by laya/kernels.py (why it exists is said
   there); every loop runs on the OpenMP threads of the torch that loaded it.

   Each kernel keeps a row's bits its own. Attention: every (row, head) pair is one task, whose q, k and v are
   widened to fp32 (q and k rotated) into the task's own buffers, whose scores, softmax and weighted sum of v run
   in fp32 and whose result is rounded once to bf16; a task reads only its own row's tokens and every sum runs in
   an order fixed by that row's length. The norms work token by token, the linears output by output. So no result
   depends on the batch mates, the thread count or which thread ran it. The vector code is written with GCC's
   vector extensions (16 floats), which the compiler maps onto AVX-512, AVX2 or SSE as the CPU has them. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));   /* 16 floats: one AVX-512 register, two AVX2 ones */
#define QB 4                                             /* queries per block: each key chunk loaded once for 4 */
#define MAX_CHUNKS 8                                     /* head dims up to 128, in chunks of 16 */

typedef int32_t v16i __attribute__((vector_size(64)));
static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

/* 16 floats rounded to bf16 to nearest even, as torch's float -> bfloat16 cast does (NaN stays a quiet NaN). */
static inline void store16_bf16(uint16_t *p, v16 x) {
    const v16u u = (v16u)x;
    const v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const v16u quiet_nan = (u >> 16) | 0x40u;
    const v16u nan = (v16u)((u & 0x7fffffffu) > 0x7f800000u);
    const v16u r = (nan & quiet_nan) | (~nan & rounded);
    const v16h h = __builtin_convertvector(r, v16h);
    memcpy(p, &h, sizeof h);
}

static inline v16 pick(v16i mask, v16 yes, v16 no) { return (v16)((mask & (v16i)yes) | (~mask & (v16i)no)); }

/* exp(x) for x <= 0 (a softmax's shifted scores; slightly positive x works too), within ~2 ulp: x = n ln2 + r,
   |r| <= ln2 / 2, a degree-6 polynomial for exp(r), 2^n from the exponent bits. n is rounded by adding 1.5 * 2^23,
   which also leaves n in the sum's low mantissa bits, so no float/int conversion is needed. Written out on vectors
   so every compiler and libm gives the same bits. */
static inline v16 exp16(v16 x) {
    const v16 shifter = (v16){0} + 12582912.0f;
    x = pick(x < -87.0f, (v16){0} - 87.0f, x);
    const v16 t = x * 1.44269504f + shifter;
    const v16 n = t - shifter;
    v16 r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187e-06f;
    v16 p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * (v16)(((v16i)t - (v16i)shifter + 127) << 23);
}
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* 16 bf16 values widened to fp32 (exact). */
static inline v16 load16_bf16(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    return (v16)(__builtin_convertvector(h, v16u) << 16);
}

/* Horizontal max and sum of 16 lanes, in a fixed tree order: lanes folded onto the lower 8, 4, 2, 1. */
static const v16i hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15};
static const v16i hi4 = {4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7};
static const v16i hi2 = {2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3};
static const v16i hi1 = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

static inline float hmax16(v16 x) {
    v16 y = __builtin_shuffle(x, hi8);
    x = pick(y > x, y, x);
    y = __builtin_shuffle(x, hi4);
    x = pick(y > x, y, x);
    y = __builtin_shuffle(x, hi2);
    x = pick(y > x, y, x);
    y = __builtin_shuffle(x, hi1);
    return y[0] > x[0] ? y[0] : x[0];
}

static inline float hsum16(v16 x) {
    x += __builtin_shuffle(x, hi8);
    x += __builtin_shuffle(x, hi4);
    x += __builtin_shuffle(x, hi2);
    return x[0] + x[1];
}

/* 16 dims of q or k rotated by their token's cos and sin (`cs`, interleaved): lanes (2j, 2j + 1) are one complex
   number, times cos + i sin. */
static inline v16 rotate16(v16 x, const float *cs) {
    const v16i even = {0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14}, odd = even + 1;
    const v16i swap = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    const v16 sign = {-1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1};
    const v16 r = load16(cs);
    return x * __builtin_shuffle(r, even) + __builtin_shuffle(x, swap) * (__builtin_shuffle(r, odd) * sign);
}

/* One (row, head) task: nq queries (q rows q0.., q at column q_off) attend to nk keys (kv rows k0.., k at
   k_off, v at v_off), over buffers of the task's own: q [nq4][hd] (scaled), kt [hd][np] (k transposed, zero past
   nk), v [nk][hd], s [QB][np]; nq4 and np: nq rounded up to QB, nk to 32. With `rope` (self-attention only: q0 ==
   k0, nq == nk), q and k are rotated by their token's row of it. */
static inline __attribute__((always_inline)) void row_head(
        const uint16_t *qsrc, long q_ld, long q_off, int q0, int nq, const uint16_t *kvsrc, long kv_ld, long k_off,
        long v_off, int k0, int nk, const int hd, const float *rope, int window, float scale, uint16_t *out,
        long out_ld, long out_off, float *q, float *kt, float *v, float *s) {
    const int chunks = hd / 16;
    const int n4 = (nq + QB - 1) / QB * QB, np = (nk + 31) / 32 * 32, n = nk;
    for (int t = 0; t < nq; t++) {
        const uint16_t *src = qsrc + (long)(q0 + t) * q_ld + q_off;
        const float *cs = rope ? rope + (long)(q0 + t) * hd : NULL;
        for (int c = 0; c < chunks; c++) {
            v16 qc = load16_bf16(src + 16 * c);
            if (cs) qc = rotate16(qc, cs + 16 * c);
            store16(q + t * hd + 16 * c, qc * scale);
        }
    }
    for (int t = 0; t < nk; t++) {
        const uint16_t *src = kvsrc + (long)(k0 + t) * kv_ld;
        const float *cs = rope ? rope + (long)(k0 + t) * hd : NULL;
        for (int c = 0; c < chunks; c++) {
            v16 kc = load16_bf16(src + k_off + 16 * c);
            if (cs) kc = rotate16(kc, cs + 16 * c);
            for (int k = 0; k < 16; k++) kt[(16 * c + k) * np + t] = kc[k];
            store16(v + t * hd + 16 * c, load16_bf16(src + v_off + 16 * c));
        }
    }
    memset(q + (long)nq * hd, 0, sizeof(float) * (size_t)(n4 - nq) * hd);
    for (int d = 0; d < hd; d++)
        for (int t = nk; t < np; t++) kt[d * np + t] = 0.0f;

    for (int i0 = 0; i0 < n4; i0 += QB) {
        /* The keys any query of the block may see, in whole pairs of 16-key chunks. */
        int lo = 0, hi = n;
        if (window >= 0) {
            lo = i0 - window > 0 ? i0 - window : 0;
            hi = i0 + QB - 1 + window + 1 < n ? i0 + QB - 1 + window + 1 : n;
        }
        const int c0 = lo / 32 * 32, c1 = (hi + 31) / 32 * 32;
        /* Scores: s[b][j] = q[i0 + b] . k[j], each a sum over d in order, whatever the block or chunk. Two key
           chunks at a time: 8 independent sums keep both FMA units busy past their latency. */
        for (int j = c0; j < c1; j += 32) {
            v16 acc0[QB], acc1[QB];
            for (int b = 0; b < QB; b++) acc0[b] = acc1[b] = (v16){0};
            for (int d = 0; d < hd; d++) {
                const v16 k0 = load16(kt + d * np + j), k1 = load16(kt + d * np + j + 16);
                for (int b = 0; b < QB; b++) {
                    const float qd = q[(i0 + b) * hd + d];
                    acc0[b] += qd * k0;
                    acc1[b] += qd * k1;
                }
            }
            for (int b = 0; b < QB; b++) {
                store16(s + b * np + j, acc0[b]);
                store16(s + b * np + j + 16, acc1[b]);
            }
        }
        /* Softmax of each query's own keys (a row's window clipped to the row), weights left in s. */
        float inv[QB];
        for (int b = 0; b < QB; b++) {
            const int i = i0 + b;
            float *sb = s + b * np;
            int a = 0, e = n;
            if (window >= 0) {
                a = i - window > 0 ? i - window : 0;
                e = i + window + 1 < n ? i + window + 1 : n;
            }
            if (i >= nq) { a = e = c0; }   /* a padding query: no weights */
            /* Keys outside [a, e) get weight 0; lanes are reduced in a fixed order. */
            v16 m16 = (v16){0} - INFINITY;
            for (int j = c0; j < c1; j += 16) {
                v16 x = load16(sb + j);
                if (j < a || j + 16 > e) {
                    const v16i idx = (v16i){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + j;
                    x = pick((idx >= a) & (idx < e), x, (v16){0} - INFINITY);
                }
                m16 = pick(x > m16, x, m16);
            }
            const float m = hmax16(m16);
            v16 sum16 = (v16){0};
            for (int j = c0; j < c1; j += 16) {
                v16 p = exp16(load16(sb + j) - m);
                if (j < a || j + 16 > e) {
                    const v16i idx = (v16i){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + j;
                    p = (v16)((v16i)p & ((idx >= a) & (idx < e)));
                }
                store16(sb + j, p);
                sum16 += p;
            }
            const float total = hsum16(sum16);
            inv[b] = total > 0.0f ? 1.0f / total : 0.0f;
        }
        /* Weighted sum of v, summed over j in order. */
        v16 acc[QB][MAX_CHUNKS];
        for (int b = 0; b < QB; b++)
            for (int c = 0; c < chunks; c++) acc[b][c] = (v16){0};
        const int jn = c1 < n ? c1 : n;
        for (int j = c0; j < jn; j++) {
            const float *vj = v + (long)j * hd;
            for (int c = 0; c < chunks; c++) {
                const v16 vc = load16(vj + 16 * c);
                for (int b = 0; b < QB; b++) acc[b][c] += s[b * np + j] * vc;
            }
        }
        for (int b = 0; b < QB && i0 + b < nq; b++) {
            uint16_t *dst = out + (long)(q0 + i0 + b) * out_ld + out_off;
            for (int c = 0; c < chunks; c++) store16_bf16(dst + 16 * c, acc[b][c] * inv[b]);
        }
    }
}

/* row_head with the head size a constant, so that its loops over head dims unroll and its accumulators stay in
   registers. */
typedef void (*row_head_fn)(const uint16_t *, long, long, int, int, const uint16_t *, long, long, long, int, int,
                            const float *, int, float, uint16_t *, long, long, float *, float *, float *, float *);
#define ROW_HEAD_FOR(HD)                                                                                           \
    static void row_head_##HD(const uint16_t *qsrc, long q_ld, long q_off, int q0, int nq, const uint16_t *kvsrc,  \
                              long kv_ld, long k_off, long v_off, int k0, int nk, const float *rope, int window,   \
                              float scale, uint16_t *out, long out_ld, long out_off, float *q, float *kt, float *v, \
                              float *s) {                                                                          \
        row_head(qsrc, q_ld, q_off, q0, nq, kvsrc, kv_ld, k_off, v_off, k0, nk, HD, rope, window, scale, out,      \
                 out_ld, out_off, q, kt, v, s);                                                                    \
    }
ROW_HEAD_FOR(16)
ROW_HEAD_FOR(32)
ROW_HEAD_FOR(64)
ROW_HEAD_FOR(128)

/* Attention of each row's queries over its own keys. q: [q_tokens, q_ld] bf16, head h's query at column h*hd;
   kv: [.., kv_ld] bf16, head h's key at column h*hd and value at hidden + h*hd (for self-attention over one q|k|v
   GEMM result, q = qkv and kv = qkv + hidden). q_starts, kv_starts: each row's first query and key, then their
   ends (rows + 1 entries). rope: [tokens, hd/2] complex (cos, sin) or NULL (self-attention only: q's and k's
   rotate-half pairs interleaved). window: attend only |i - j| <= window (self-attention), or -1. out: [q_tokens,
   hidden] bf16, queries after the last row zeroed. Returns 0, or -1 if a buffer could not be allocated or hd is
   not 16, 32, 64 or 128. */
int pagoda_attention(const uint16_t *q, long q_ld, const int *q_starts, int q_tokens, const uint16_t *kv, long kv_ld,
                     const int *kv_starts, int rows, int heads, int hd, const float *rope, int window, uint16_t *out,
                     int threads) {
    const long hidden = (long)heads * hd;
    int longest = 0;
    for (int r = 0; r < rows; r++) {
        const int nq = q_starts[r + 1] - q_starts[r], nk = kv_starts[r + 1] - kv_starts[r];
        longest = nq > longest ? nq : longest;
        longest = nk > longest ? nk : longest;
    }
    const row_head_fn run = hd == 16 ? row_head_16 : hd == 32 ? row_head_32 : hd == 64 ? row_head_64
                          : hd == 128 ? row_head_128 : NULL;
    int failed = 0;
    const float scale = 1.0f / sqrtf((float)hd);
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const size_t np = (size_t)(longest + 31) / 32 * 32, per = np * hd;
        float *buf = run ? malloc(sizeof(float) * (3 * per + QB * np)) : NULL;
        if (!buf) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (long task = 0; task < (long)rows * heads; task++) {
            const int r = (int)(task / heads), h = (int)(task % heads);
            const int nq = q_starts[r + 1] - q_starts[r], nk = kv_starts[r + 1] - kv_starts[r];
            if (!buf || nq <= 0) continue;
            if (nk <= 0) {     /* no keys: no attention, zeros (torch would give NaN) */
                for (int i = 0; i < nq; i++)
                    memset(out + (long)(q_starts[r] + i) * hidden + h * hd, 0, sizeof(uint16_t) * hd);
                continue;
            }
            run(q, q_ld, h * hd, q_starts[r], nq, kv, kv_ld, h * hd, hidden + h * hd, kv_starts[r], nk, rope, window,
                scale, out, hidden, h * hd, buf, buf + per, buf + 2 * per, buf + 3 * per);
        }
        free(buf);
    }
    if (rows >= 0 && q_starts[rows] < q_tokens)
        memset(out + (long)q_starts[rows] * hidden, 0, sizeof(uint16_t) * (size_t)(q_tokens - q_starts[rows]) * hidden);
    return failed ? -1 : 0;
}

/* out = residual + y widened: the fp32 residual stream plus a bf16 GEMM result, the one rounding of an fp32 add
   (the bits of torch.add(residual, y)), without torch's mixed-type path, which took ~90 us a call at model
   width. n: elements, a multiple of 16 or not. */
void pagoda_add_widened(const float *residual, const uint16_t *y, float *out, long n, int threads) {
    const long blocks = (n + 1023) / 1024;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long blk = 0; blk < blocks; blk++) {
        const long end = (blk + 1) * 1024 < n ? (blk + 1) * 1024 : n;
        long i = blk * 1024;
        for (; i + 16 <= end; i += 16) store16(out + i, load16(residual + i) + load16_bf16(y + i));
        for (; i < end; i++) {
            const uint32_t u = (uint32_t)y[i] << 16;
            float f;
            memcpy(&f, &u, sizeof f);
            out[i] = residual[i] + f;
        }
    }
}

/* Layer norm of fp32 tokens [tokens, d] straight to the bf16 input of the next GEMM, per token (a token's bits
   depend on that token alone): the mean, then the variance around it, each summed in 16 lanes reduced in a fixed
   tree. With y (a bf16 GEMM result), the norm is of x + y, which is also written to `sum` (the residual stream's
   next value, the bits of torch.add(x, y)): one pass over the token instead of an add and a norm. weight and bias
   may be NULL (ModernBERT's norms have no bias). d: a multiple of 16. */
void pagoda_layer_norm_bf16(const float *x, const uint16_t *y, float *sum, int tokens, int d, const float *weight,
                            const float *bias, float eps, uint16_t *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < tokens; t++) {
        const float *xt = x + (long)t * d;
        if (y) {
            float *st = sum + (long)t * d;
            for (int i = 0; i < d; i += 16) store16(st + i, load16(xt + i) + load16_bf16(y + (long)t * d + i));
            xt = st;
        }
        v16 sum16 = (v16){0};
        for (int i = 0; i < d; i += 16) sum16 += load16(xt + i);
        const float mean = hsum16(sum16) / (float)d;
        v16 sq16 = (v16){0};
        for (int i = 0; i < d; i += 16) {
            const v16 c = load16(xt + i) - mean;
            sq16 += c * c;
        }
        const float rstd = 1.0f / sqrtf(hsum16(sq16) / (float)d + eps);
        uint16_t *o = out + (long)t * d;
        for (int i = 0; i < d; i += 16) {
            v16 v = (load16(xt + i) - mean) * rstd;
            if (weight) v = v * load16(weight + i);
            if (bias) v = v + load16(bias + i);
            store16_bf16(o + i, v);
        }
    }
}

/* y[r] = w x[r] + b for a few fp32 rows (the scorer's and act head's linears): each output a dot product summed in
   16 lanes over the input in order, then reduced in a fixed tree, so a row's bits are its own whatever the row
   count. A weight row is read once for all rows (torch.mv per row re-read the whole matrix per row, from beyond
   L2 at model width). b may be NULL. */
void pagoda_rows_linear(const float *w, const float *b, int out, int in, const float *x, int rows, float *y,
                        int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int o = 0; o < out; o++) {
        const float *wo = w + (long)o * in;
        for (int r = 0; r < rows; r++) {
            const float *xr = x + (long)r * in;
            v16 acc = (v16){0};
            int i = 0;
            for (; i + 16 <= in; i += 16) acc += load16(wo + i) * load16(xr + i);
            float sum = hsum16(acc);
            for (; i < in; i++) sum += wo[i] * xr[i];
            y[(long)r * out + o] = sum + (b ? b[o] : 0.0f);
        }
    }
}
