/*
 * group_kernel (../quant.h) for an architecture file that has defined its always-inlined
 * group_rows(w, is_q8, x, rows, nb, out): one copy of it per format and row count, each with constants that
 * unroll its loops and keep its accumulators in registers. Included once, at the end of such a file.
 */
void group_kernel(const void *w, int is_q8, const block_q8a *const *x, int rows, int64_t nb, float *out) {
    switch (rows * 2 + (is_q8 != 0)) {
        case 2: group_rows(w, 0, x, 1, nb, out); break;
        case 3: group_rows(w, 1, x, 1, nb, out); break;
        case 4: group_rows(w, 0, x, 2, nb, out); break;
        case 5: group_rows(w, 1, x, 2, nb, out); break;
        case 6: group_rows(w, 0, x, 3, nb, out); break;
        case 7: group_rows(w, 1, x, 3, nb, out); break;
        case 8: group_rows(w, 0, x, 4, nb, out); break;
        default: group_rows(w, 1, x, 4, nb, out); break;
    }
}
