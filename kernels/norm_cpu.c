/* Instance normalisation with its affine, then optionally Hardswish, of channels-last maps on
 * the CPU at inference (hsmla_med.nn.blocks.InstanceNorm in a ConvNormAct).
 *
 * PyTorch spends five passes over the map on it (the mean, the deviation, its square, their
 * mean, the scaled sum) and a sixth on the activation, and allocates two maps; here it is two
 * passes, one reading the map for every channel's sums and one writing the result, in place if
 * asked. The sums are taken in double precision from the first position's values (a shift that
 * keeps them small when the mean is far from zero), so sum-of-squares cancellation costs nothing
 * a float32 result can show, and the map is normalised as (x - first) * scale + offset: no
 * float32 product of the mean cancels against the shift, as in x * scale + (bias - mean * scale)
 * (the reference's form, which loses about 1e-2 on a channel of mean 1000 and deviation 0.01).
 *
 * Maps are (batch, positions, channels) with the channels contiguous: a channels-last 2D or 3D
 * map with its spatial axes flattened. Compiled at first use by _cpu_build.py.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_team.h"

/* x: the map; y: the output (may be x). weight, bias: (channels,). hardswish: 0 or 1.
 * Returns 0, or -1 when the scratch memory cannot be allocated. */
int hsmla_instance_norm_act(const float *x, float *y, int64_t batch, int64_t positions, int64_t channels,
                            const float *weight, const float *bias, float eps, int hardswish) {
    const int threads = hsmla_team_size(positions, positions * channels);
    double *partial = malloc(sizeof(double) * 2 * (size_t)channels * (size_t)threads);
    float *first = malloc(sizeof(float) * 3 * (size_t)channels); /* then the scale and the offset */
    if (partial == NULL || first == NULL) {
        free(partial);
        free(first);
        return -1;
    }
    float *scale = first + channels, *offset = first + 2 * channels;
    for (int64_t b = 0; b < batch; ++b) {
        const float *xb = x + b * positions * channels;
        float *yb = y + b * positions * channels;
        /* the first position's values, kept apart: an in-place second pass overwrites them */
        memcpy(first, xb, sizeof(float) * (size_t)channels);
        memset(partial, 0, sizeof(double) * 2 * (size_t)channels * (size_t)threads);
#pragma omp parallel num_threads(threads)
        {
            double *sum = partial + 2 * channels * omp_get_thread_num(), *squares = sum + channels;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < positions; ++p) {
                const float *row = xb + p * channels;
#pragma omp simd
                for (int64_t c = 0; c < channels; ++c) {
                    const double d = (double)row[c] - (double)first[c];
                    sum[c] += d;
                    squares[c] += d * d;
                }
            }
#pragma omp single
            for (int64_t c = 0; c < channels; ++c) {
                double s = 0.0, q = 0.0;
                for (int t = 0; t < threads; ++t) {
                    s += partial[2 * channels * t + c];
                    q += partial[2 * channels * t + channels + c];
                }
                const double shifted = s / (double)positions, var = fmax(q / (double)positions - shifted * shifted, 0.0);
                const double k = (double)weight[c] / sqrt(var + (double)eps);
                offset[c] = (float)((double)bias[c] - shifted * k);
                scale[c] = (float)k;
            }
#pragma omp for schedule(static)
            for (int64_t p = 0; p < positions; ++p) {
                const float *row = xb + p * channels;
                float *out = yb + p * channels;
                if (hardswish) {
#pragma omp simd
                    for (int64_t c = 0; c < channels; ++c) {
                        const float v = (row[c] - first[c]) * scale[c] + offset[c];
                        float gate = v + 3.0f; /* relu6(v + 3), as comparisons: fminf/fmaxf do not vectorise */
                        gate = gate < 0.0f ? 0.0f : gate;
                        gate = gate > 6.0f ? 6.0f : gate;
                        out[c] = v * gate / 6.0f;
                    }
                } else {
#pragma omp simd
                    for (int64_t c = 0; c < channels; ++c) out[c] = (row[c] - first[c]) * scale[c] + offset[c];
                }
            }
        }
    }
    free(partial);
    free(first);
    return 0;
}
