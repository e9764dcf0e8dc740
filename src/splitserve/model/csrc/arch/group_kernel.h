/*
 * group_kernel (../quant.h) for an architecture file that has defined its always-inlined
 * group_rows(w, fmt, x, rows, nb, out): one copy of it per format and row count, each with constants that fold
 * the format's branches, unroll its loops and keep its accumulators in registers. Included once, at the end of
 * such a file.
 */
#define SS_GROUP_ROWS(F)                                   \
    switch (rows) {                                        \
        case 1: group_rows(w, F, x, 1, nb, out); return;   \
        case 2: group_rows(w, F, x, 2, nb, out); return;   \
        case 3: group_rows(w, F, x, 3, nb, out); return;   \
        default: group_rows(w, F, x, 4, nb, out); return;  \
    }

void group_kernel(const void *w, int fmt, const block_q8a *const *x, int rows, int64_t nb, float *out) {
    switch (fmt) {
        case FMT_Q4: SS_GROUP_ROWS(FMT_Q4)
        case FMT_Q5: SS_GROUP_ROWS(FMT_Q5)
        case FMT_Q8: SS_GROUP_ROWS(FMT_Q8)
        case FMT_IQ4: SS_GROUP_ROWS(FMT_IQ4)
        case FMT_Q4K: SS_GROUP_ROWS(FMT_Q4K)
        case FMT_Q5K: SS_GROUP_ROWS(FMT_Q5K)
        case FMT_Q2K: SS_GROUP_ROWS(FMT_Q2K)
        case FMT_IQ4K: SS_GROUP_ROWS(FMT_IQ4K)
        default: SS_GROUP_ROWS(FMT_Q6K)
    }
}
#undef SS_GROUP_ROWS
