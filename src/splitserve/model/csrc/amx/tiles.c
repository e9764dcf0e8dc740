/*
 * AMX's one piece of process state: Linux hands out the tile registers only on request, once per process,
 * before the first tile instruction (amx/attention.c, amx/quant_matmul.c).
 */
#include "../common.h"
#include "../ss_kernels.h"

#if defined(SS_AMX)
#include <sys/syscall.h>
#include <unistd.h>

int ss_amx_permitted(void) {
    static int state; /* 0: not asked, 1: granted, -1: refused */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return state > 0;
}
#else
int ss_amx_permitted(void) { return 0; }
#endif
