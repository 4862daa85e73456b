/* The HSMLA block gate on the CPU at inference (DESIGN.md §3 step 4), from a channels-last map.
 *
 * For each tile b: pooled = AvgPool_B(DWConv3x3(ms)), evaluated as the layer's fused depthwise
 * kernel of (B+2)^s taps at stride B with padding 1; G_h = sigmoid(w_h . pooled[head h] + b_h)
 * over head h's channels of Qh, Kh, Vh; M_b = mean_h G_h. One pass over the map, vectorised
 * over its channels, replaces a strided convolution and four small tensor operations whose
 * dispatch cost more than their arithmetic.
 *
 * Maps are (batch, Z, Y, X, channels) with the channels contiguous; 2D maps pass Z = 1, block
 * 1 and one tap on that axis. Compiled at first use by _cpu_build.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_team.h"

/* ms: the map, stride: its element strides (batch, z, y, x); channels = 3 heads head_dim.
 * taps: (kz ky kx, channels), the fused kernel tap by tap; conv_bias: (channels,).
 * weight: (channels,) w_h laid out as the channels (Q, K, V blocks, each head by head);
 * gate_bias: (heads,). gate: (batch, tiles z, tiles y, tiles x), written.
 * Returns 0, or -1 when the scratch memory cannot be allocated. */
int hsmla_block_gate(const float *ms, const int64_t stride[4], int64_t batch, int64_t channels, const int64_t size[3],
                     const int64_t block[3], const int64_t tiles[3], const float *taps, const int64_t kernel[3],
                     const float *conv_bias, const float *weight, const float *gate_bias, int64_t heads,
                     float *gate) {
    const int64_t per_batch = tiles[0] * tiles[1] * tiles[2], width = channels / 3, d = width / heads;
    const int64_t kernel_volume = kernel[0] * kernel[1] * kernel[2];
    int failed = 0;
#pragma omp parallel num_threads(hsmla_team_size(batch * per_batch, batch * per_batch * kernel_volume * channels)) reduction(| : failed)
    {
        float *pooled = malloc(sizeof(float) * (size_t)channels);
        failed = pooled == NULL;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < batch * per_batch; ++item) {
            if (failed) continue;
            const int64_t b = item / per_batch, t = item % per_batch;
            const int64_t tile[3] = {t / (tiles[1] * tiles[2]), t / tiles[2] % tiles[1], t % tiles[2]};
            int64_t origin[3];
            for (int a = 0; a < 3; ++a) origin[a] = tile[a] * block[a] - (kernel[a] - block[a]) / 2; /* padding */
            for (int64_t c = 0; c < channels; ++c) pooled[c] = conv_bias[c];
            for (int64_t kz = 0; kz < kernel[0]; ++kz)
                for (int64_t ky = 0; ky < kernel[1]; ++ky)
                    for (int64_t kx = 0; kx < kernel[2]; ++kx) {
                        const int64_t z = origin[0] + kz, y = origin[1] + ky, x = origin[2] + kx;
                        if (z < 0 || z >= size[0] || y < 0 || y >= size[1] || x < 0 || x >= size[2]) continue;
                        const float *row = ms + b * stride[0] + z * stride[1] + y * stride[2] + x * stride[3];
                        const float *tap = taps + ((kz * kernel[1] + ky) * kernel[2] + kx) * channels;
#pragma omp simd
                        for (int64_t c = 0; c < channels; ++c) pooled[c] += tap[c] * row[c];
                    }
            float mean = 0.0f;
            for (int64_t h = 0; h < heads; ++h) {
                float logit = gate_bias[h];
                for (int part = 0; part < 3; ++part) { /* head h's channels of Qh, Kh and Vh */
                    const int64_t first = part * width + h * d;
#pragma omp simd reduction(+ : logit)
                    for (int64_t i = 0; i < d; ++i) logit += weight[first + i] * pooled[first + i];
                }
                mean += 1.0f / (1.0f + expf(-logit));
            }
            gate[item] = mean / (float)heads;
        }
        free(pooled);
    }
    return failed ? -1 : 0;
}
