/* Tile-compacted local refinement of HSMLA attention on the CPU (DESIGN.md §3 steps 5-6, §4).
 *
 * The CPU counterpart of refine.py's Triton kernel, for the inference path: for each active tile
 * and head it evaluates each query's window softmax term and local linear term in float32 and
 * adds weight * (O_loc - O_linloc) into the output in place. It reads the feature maps where
 * they lie (any strides, head_dim contiguous) and touches no token outside the active tiles'
 * halos, which is what the PyTorch reference spends most of its time on (stacking, gathering
 * and scattering whole tensors per layer).
 *
 * Maps are (batch, heads, Z, Y, X, head_dim); 2D maps pass Z = 1, block and radius 1 and 0 on
 * that axis. Compiled at first use by _cpu_build.py with -O3 -march=native.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_team.h"

/* Queries are evaluated LANES at a time, one per vector lane: every loop over queries below has
 * this constant trip count and vectorises whole (16 float32 lanes: one AVX-512 register). */
#define LANES 16
/* value channels whose sums over the keys stay in registers: 2 x 8 vectors of LANES */
#define CHANNELS 8
typedef float lanes __attribute__((vector_size(LANES * sizeof(float))));

typedef struct {
    const float *data;
    int64_t stride[5]; /* batch, head, z, y, x; head_dim is contiguous */
} feature_map;

/* e^x of LANES arguments x <= 0, in loops the compiler vectorises: 2^(x log2 e) split into an
 * integer power, built in the exponent bits, and a degree-6 polynomial for 2^f, f in [0, 1)
 * (relative error below 1e-7 in float32). Arguments are clamped to [-87, 0] (e^-87 is 1.6e-38):
 * keys outside the window, whose scores may exceed the window's maximum, get weight zero from
 * the caller. The exponent bits pass through memcpy, which vectorises where a union does not. */
static inline void exp_nonpositive(const float *x, float *out) {
    float f[LANES];
    int32_t bits[LANES];
#pragma omp simd
    for (int p = 0; p < LANES; ++p) {
        const float t = (x[p] < -87.0f ? -87.0f : (x[p] > 0.0f ? 0.0f : x[p])) * 1.4426950408889634f;
        const float n = floorf(t);
        f[p] = t - n;
        bits[p] = ((int32_t)n + 127) << 23;
    }
    memcpy(out, bits, sizeof bits);
#pragma omp simd
    for (int p = 0; p < LANES; ++p) {
        float q = 2.1702226878392294e-4f;
        q = q * f[p] + 1.2439693769469018e-3f;
        q = q * f[p] + 9.678840652627918e-3f;
        q = q * f[p] + 5.548334196876553e-2f;
        q = q * f[p] + 2.4022983633519773e-1f;
        q = q * f[p] + 6.93146983827555e-1f;
        q = q * f[p] + 1.0000000018563484f;
        out[p] *= q;
    }
}

static inline const float *token(const feature_map *m, int64_t b, int64_t h, int64_t z, int64_t y, int64_t x) {
    return m->data + b * m->stride[0] + h * m->stride[1] + z * m->stride[2] + y * m->stride[3] + x * m->stride[4];
}

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Ask for the next item's halo while this one computes: a head's channels of a token are a
 * short run inside the token's row, a pattern the hardware prefetchers do not follow, and
 * waiting on each cache miss doubled the kernel's time inside a network. */
static void prefetch_item(const feature_map maps[6], const int64_t *tiles, int64_t item, int64_t heads,
                          const int64_t size[3], const int64_t block[3], const int64_t radius[3], int64_t d) {
    const int64_t *tile = tiles + 4 * (item / heads);
    const int64_t b = tile[0], h = item % heads;
    int64_t lo[3], hi[3];
    for (int a = 0; a < 3; ++a) {
        lo[a] = max64(tile[1 + a] * block[a] - radius[a], 0);
        hi[a] = min64((tile[1 + a] + 1) * block[a] + radius[a], size[a]);
    }
    for (int64_t z = lo[0]; z < hi[0]; ++z)
        for (int64_t y = lo[1]; y < hi[1]; ++y)
            for (int64_t x = lo[2]; x < hi[2]; ++x)
                for (int m = 0; m < 6; ++m) {
                    const char *row = (const char *)token(&maps[m], b, h, z, y, x);
                    for (int64_t offset = 0; offset < d * (int64_t)sizeof(float); offset += 64)
                        __builtin_prefetch(row + offset, 0, 2);
                }
}

/* All (tile, head) pairs of the listed tiles: items = tiles x heads, item = tile * heads + head.
 *
 * maps: q, k, v, qh, kh, vh.  out: (batch, heads, Z, Y, X, head_dim) with out_stride giving
 * all six strides.  tiles: (n, 4) rows (batch, tile z, tile y, tile x).  weights: (n,) factors
 * of each tile's residual.  size, block, radius: per axis z, y, x.
 *
 * For each group of up to LANES queries of a tile, pass 1 scores every key of the box that
 * their windows cover (softmax q.k / sqrt(d) and linear phi(qh).phi(kh), keys outside a
 * query's window masked), pass 2 turns the scores into softmax weights, pass 3 sums the
 * weighted values of both terms, and the residual is added to the output. Keys and values are
 * read from the maps where they lie.
 * Returns 0, or -1 when the scratch memory cannot be allocated. */
int hsmla_refine_tiles(const feature_map maps[6], float *out, const int64_t out_stride[6], const int64_t *tiles,
                       const float *weights, int64_t items, int64_t heads, const int64_t size[3],
                       const int64_t block[3], const int64_t radius[3], int64_t head_dim, float eps) {
    const int64_t d = head_dim;
    int64_t max_keys = 1;
    for (int a = 0; a < 3; ++a) max_keys *= block[a] + 2 * radius[a];
    const float scale = 1.0f / sqrtf((float)d);
    const int32_t rz = (int32_t)radius[0], ry = (int32_t)radius[1], rx = (int32_t)radius[2];
    const int64_t tile_queries = block[0] * block[1] * block[2];
    int failed = 0;

    /* torch's own OpenMP runtime (the library's libgomp.so.1 resolves to the one torch loaded),
     * so its worker threads, still spinning after the previous torch operation, take the items */
#pragma omp parallel num_threads(hsmla_team_size(items, items * tile_queries * max_keys * d)) reduction(| : failed)
    {
        /* per thread: queries (d x LANES, transposed), scores and linear weights of the box's keys,
         * value accumulators (d x LANES) of both terms */
        float *scratch = malloc(sizeof(float) * (size_t)(LANES * (4 * d + 2 * max_keys)));
        failed = scratch == NULL;
        float *q_t = scratch, *qh_t = q_t + d * LANES, *acc = qh_t + d * LANES, *acc_lin = acc + d * LANES;
        float *score = acc_lin + d * LANES, *linear = score + max_keys * LANES;

#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; ++item) {
            if (failed) continue;
            if (item + 1 < items) prefetch_item(maps, tiles, item + 1, heads, size, block, radius, d);
            const int64_t *tile = tiles + 4 * (item / heads);
            const int64_t b = tile[0], h = item % heads;
            const float weight = weights[item / heads];
            int64_t origin[3];
            for (int a = 0; a < 3; ++a) origin[a] = tile[1 + a] * block[a];

            for (int64_t first = 0; first < tile_queries; first += LANES) {
                /* this group's queries (those inside the map), and the box their windows cover */
                int32_t qz[LANES], qy[LANES], qx[LANES];
                int64_t count = 0, lo[3] = {INT64_MAX, INT64_MAX, INT64_MAX}, hi[3] = {-1, -1, -1};
                for (int64_t i = first; i < min64(first + LANES, tile_queries); ++i) {
                    const int64_t c[3] = {origin[0] + i / (block[1] * block[2]), origin[1] + i / block[2] % block[1],
                                          origin[2] + i % block[2]};
                    if (c[0] >= size[0] || c[1] >= size[1] || c[2] >= size[2]) continue; /* partial edge tile */
                    qz[count] = (int32_t)c[0];
                    qy[count] = (int32_t)c[1];
                    qx[count] = (int32_t)c[2];
                    for (int a = 0; a < 3; ++a) {
                        lo[a] = min64(lo[a], max64(c[a] - radius[a], 0));
                        hi[a] = max64(hi[a], min64(c[a] + radius[a] + 1, size[a]));
                    }
                    const float *q = token(&maps[0], b, h, c[0], c[1], c[2]), *qh = token(&maps[3], b, h, c[0], c[1], c[2]);
                    for (int64_t ch = 0; ch < d; ++ch) {
                        q_t[ch * LANES + count] = q[ch] * scale;
                        qh_t[ch * LANES + count] = qh[ch] > 0.0f ? qh[ch] : 0.0f;
                    }
                    ++count;
                }
                if (count == 0) continue;
                for (int64_t p = count; p < LANES; ++p) { /* idle lanes: a copy of the first query */
                    qz[p] = qz[0];
                    qy[p] = qy[0];
                    qx[p] = qx[0];
                    for (int64_t ch = 0; ch < d; ++ch) q_t[ch * LANES + p] = qh_t[ch * LANES + p] = 0.0f;
                }

                /* pass 1: scores and linear weights, and each lane's maximum score */
                float top[LANES];
                #pragma omp simd
                for (int p = 0; p < LANES; ++p) top[p] = -INFINITY;
                int64_t j = 0;
                for (int64_t z = lo[0]; z < hi[0]; ++z)
                    for (int64_t y = lo[1]; y < hi[1]; ++y)
                        for (int64_t x = lo[2]; x < hi[2]; ++x, ++j) {
                            const float *k = token(&maps[1], b, h, z, y, x), *kh = token(&maps[4], b, h, z, y, x);
                            float s[LANES] = {0}, l[LANES] = {0};
                            for (int64_t ch = 0; ch < d; ++ch) {
                                const float kc = k[ch], khc = kh[ch] > 0.0f ? kh[ch] : 0.0f;
                                const float *qc = q_t + ch * LANES, *qhc = qh_t + ch * LANES;
                                #pragma omp simd
                                for (int p = 0; p < LANES; ++p) {
                                    s[p] += qc[p] * kc;
                                    l[p] += qhc[p] * khc;
                                }
                            }
                            float *sj = score + j * LANES, *lj = linear + j * LANES;
                            #pragma omp simd
                            for (int p = 0; p < LANES; ++p) {
                                const int in = (abs((int32_t)z - qz[p]) <= rz) & (abs((int32_t)y - qy[p]) <= ry) &
                                               (abs((int32_t)x - qx[p]) <= rx);
                                sj[p] = in ? s[p] : -INFINITY;
                                lj[p] = in ? l[p] : 0.0f;
                                top[p] = sj[p] > top[p] ? sj[p] : top[p];
                            }
                        }

                /* pass 2: softmax weights in place of the scores, and the totals */
                const int64_t keys = j;
                float total[LANES] = {0}, total_lin[LANES] = {0};
                for (int64_t i = 0; i < keys; ++i) {
                    float *si = score + i * LANES, shifted[LANES], pr[LANES];
                    const float *li = linear + i * LANES;
                    #pragma omp simd
                    for (int p = 0; p < LANES; ++p) shifted[p] = si[p] - top[p];
                    exp_nonpositive(shifted, pr);
                    #pragma omp simd
                    for (int p = 0; p < LANES; ++p) {
                        si[p] = si[p] == -INFINITY ? 0.0f : pr[p];
                        total[p] += si[p];
                        total_lin[p] += li[p];
                    }
                }

                /* pass 3: both terms' weighted values, CHANNELS channels at a time, their sums
                 * held in vector registers across all keys */
                for (int64_t c0 = 0; c0 < d; c0 += CHANNELS) {
                    const int64_t width = min64(CHANNELS, d - c0);
                    lanes sum[CHANNELS], sum_lin[CHANNELS];
                    for (int c = 0; c < CHANNELS; ++c) sum[c] = sum_lin[c] = (lanes){0};
                    j = 0;
                    for (int64_t z = lo[0]; z < hi[0]; ++z)
                        for (int64_t y = lo[1]; y < hi[1]; ++y)
                            for (int64_t x = lo[2]; x < hi[2]; ++x, ++j) {
                                const float *v = token(&maps[2], b, h, z, y, x) + c0;
                                const float *vh = token(&maps[5], b, h, z, y, x) + c0;
                                lanes pr, w;
                                memcpy(&pr, score + j * LANES, sizeof pr);
                                memcpy(&w, linear + j * LANES, sizeof w);
                                for (int c = 0; c < CHANNELS; ++c) {
                                    sum[c] += pr * (c < width ? v[c] : 0.0f);
                                    sum_lin[c] += w * (c < width ? vh[c] : 0.0f);
                                }
                            }
                    for (int64_t c = 0; c < width; ++c) {
                        memcpy(acc + (c0 + c) * LANES, &sum[c], sizeof sum[c]);
                        memcpy(acc_lin + (c0 + c) * LANES, &sum_lin[c], sizeof sum_lin[c]);
                    }
                }

                float a[LANES], a_lin[LANES];
                #pragma omp simd
                for (int p = 0; p < LANES; ++p) {
                    a[p] = weight / total[p];
                    a_lin[p] = weight / (total_lin[p] + eps);
                }
                for (int64_t p = 0; p < count; ++p) {
                    float *o = out + b * out_stride[0] + h * out_stride[1] + qz[p] * out_stride[2] + qy[p] * out_stride[3] +
                               qx[p] * out_stride[4];
                    for (int64_t ch = 0; ch < d; ++ch)
                        o[ch * out_stride[5]] += a[p] * acc[ch * LANES + p] - a_lin[p] * acc_lin[ch * LANES + p];
                }
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
