/* The thread team of a C kernel's parallel region, by the rule PyTorch applies to its own CPU
 * loops (at::parallel_for with at::internal::GRAIN_SIZE): one thread per HSMLA_GRAIN units of
 * work (multiply-adds, or elements touched), at most one per item and at most OpenMP's maximum,
 * which follows torch.set_num_threads (the kernels run on torch's libgomp).
 *
 * Why: a region's end is a barrier that waits for every thread of its team. A small
 * region (a 3 x 3 token map's gate, a refinement of one tile) costs more in waking the team and
 * in that barrier than its arithmetic, and beside busy neighbours a descheduled thread holds the
 * barrier for a time slice; on one thread it forks nothing and waits for no one. Threads beyond
 * the items would only join the barrier. Included by each kernel; exported so that the rule is
 * tested from Python (tests/test_kernels_cpu.py).
 */
#ifndef HSMLA_CPU_TEAM_H
#define HSMLA_CPU_TEAM_H
#include <omp.h>
#include <stdint.h>

#define HSMLA_GRAIN 32768

int hsmla_team_size(int64_t items, int64_t work) {
    int64_t team = (work + HSMLA_GRAIN - 1) / HSMLA_GRAIN;
    if (team > items) team = items;
    if (team > omp_get_max_threads()) team = omp_get_max_threads();
    return team < 1 ? 1 : (int)team;
}
#endif
