/* The CPU's fp32 FMA peak and memory read rate, for `actorline bench roof`.
 *
 * The FMA peak: each thread runs independent chains of
 * vector FMAs on registers only (no memory traffic), so the rate is what the vector units can
 * do, the ceiling any GEMM kernel on this machine works under. The vector is the widest the
 * compiler targets here (AVX-512: 16 floats, AVX2: 8, NEON/SSE: 4), picked at compile time;
 * built by stages/execute/native.py's build_library like the engine's kernels. */
#include <omp.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#define CHAINS 12 /* more independent FMAs in flight than latency x units on current cores */

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));

int actorline_fma_lanes(void) { return LANES; }

/* Runs `iterations` rounds of CHAINS vector FMAs on each of `num_threads` threads; returns the
 * FLOPs done (2 per lane per FMA), or -1 for bad arguments. `sink` receives a value so the
 * work cannot be optimised away (a float recurrence over a run-time count has no closed form). */
double actorline_fma_run(int64_t iterations, int num_threads, float *sink) {
    if (iterations < 1 || num_threads < 1) return -1.0;
    float total = 0.0f;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        vf acc[CHAINS];
        vf scale = (vf){0} + 0.999999f, shift = (vf){0} + 1e-7f;
        for (int i = 0; i < CHAINS; ++i) acc[i] = (vf){0} + (float)i;
        for (int64_t r = 0; r < iterations; ++r) {
            for (int i = 0; i < CHAINS; ++i) acc[i] = acc[i] * scale + shift;
        }
        for (int i = 0; i < CHAINS; ++i) total += acc[i][0];
    }
    *sink = total;
    return 2.0 * LANES * CHAINS * (double)iterations * num_threads;
}

/* The read rate: each of `num_threads` threads sums its contiguous share of `data` (`count`
 * floats, 64-byte aligned) into CHAINS vector accumulators, so the loads stream with no
 * dependency between them (a plain reduction waits on one chain); the last thread also adds the
 * few floats past the whole blocks. Returns the sum, which the caller keeps so the loads cannot
 * be optimised away, or a negative value for bad arguments. */
double actorline_read_run(const float *data, int64_t count, int num_threads) {
    const int64_t step = (int64_t)LANES * CHAINS;
    if (count < 0 || num_threads < 1) return -1.0;
    double total = 0.0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        int threads = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t blocks = count / step, per = (blocks + threads - 1) / threads;
        int64_t first = me * per < blocks ? me * per : blocks;
        int64_t last = first + per < blocks ? first + per : blocks;
        vf acc[CHAINS];
        for (int i = 0; i < CHAINS; ++i) acc[i] = (vf){0};
        for (int64_t b = first; b < last; ++b) {
            const vf *block = (const vf *)(data + b * step);
            for (int i = 0; i < CHAINS; ++i) acc[i] += block[i];
        }
        for (int i = 0; i < CHAINS; ++i)
            for (int lane = 0; lane < LANES; ++lane) total += acc[i][lane];
        if (me == threads - 1)
            for (int64_t i = blocks * step; i < count; ++i) total += data[i];
    }
    return total;
}
