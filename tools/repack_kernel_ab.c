// One repacked Q4_K kernel from two ggml-cpu builds, called alternately in one process on the
// same random operands: how much faster build B's kernel is than build A's, and whether their
// outputs are equal bit for bit (they must be: the patch series changes instructions, never a
// row's arithmetic). A kernel's compute cost with its weights warm in cache; tools/weight_type_cost
// times whole models. A benchmark: it asserts nothing.
//
//   cc -O2 tools/repack_kernel_ab.c -o /tmp/repack_kernel_ab -ldl
//   cp A/libggml-cpu.so /tmp/a.so; cp B/libggml-cpu.so /tmp/b.so    (two paths: two handles)
//   LD_LIBRARY_PATH=<any lib folder with libggml-base> /tmp/repack_kernel_ab /tmp/a.so /tmp/b.so gemm 1536 8960 32 40
//
// Arguments: A.so B.so KERNEL K N ROWS REPS. KERNEL `gemm` is ggml_gemm_q4_K_8x8_q8_K (ROWS a
// multiple of 4, the q8_Kx4 groups a verify batch's rows go through), `gemv` is localspec's
// ggml_gemv_q4_K_8x8_q8_K_rows (ROWS q8_K rows: a one-token decode's and a batch's last 1-3).
// Weights are K x N (K a multiple of 256, N of 8), one thread. Prints the fastest and the median
// of REPS calls per build and B over A. Operands are random within the ranges real data has
// (16-element sums of int8 quants within +-2048, finite small scales).
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void (*gemm_fn)(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
typedef void (*gemv_fn)(int n, float * s, size_t bs, const void * vx, const void * vy, size_t by, int nr, int nc);

enum { Q4_KX8 = 1152, Q8_KX4 = 1168, Q8_K = 292 };   // block sizes in bytes (repack.h, ggml-common.h)

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int by_value(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return x < y ? -1 : x > y;
}

static void * kernel(const char * lib, const char * name) {
    void * h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    void * f = h ? dlsym(h, name) : NULL;
    if (!f) {
        fprintf(stderr, "repack_kernel_ab: %s\n", dlerror());
        exit(1);
    }
    return f;
}

static void sums(uint8_t * p, int count) {   // int16 bsums in real data's range
    int16_t * v = (int16_t *) p;
    for (int j = 0; j < count; j++) v[j] = (int16_t)(rand() % 4096 - 2048);
}

int main(int argc, char ** argv) {
    if (argc != 8 || (strcmp(argv[3], "gemm") && strcmp(argv[3], "gemv"))) {
        fprintf(stderr, "usage: repack_kernel_ab A.so B.so gemm|gemv K N ROWS REPS\n");
        return 2;
    }
    const int gemv = strcmp(argv[3], "gemv") == 0;
    const int n = atoi(argv[4]), nc = atoi(argv[5]), nr = atoi(argv[6]), reps = atoi(argv[7]);
    if (n <= 0 || n % 256 || nc <= 0 || nc % 8 || nr <= 0 || (!gemv && nr % 4) || reps <= 0) {
        fprintf(stderr, "repack_kernel_ab: K must be a multiple of 256, N of 8, ROWS of 4 for gemm\n");
        return 2;
    }
    const char * name = gemv ? "ggml_gemv_q4_K_8x8_q8_K_rows" : "ggml_gemm_q4_K_8x8_q8_K";
    void * fa = kernel(argv[1], name), * fb = kernel(argv[2], name);
    if (fa == fb) {
        fprintf(stderr, "repack_kernel_ab: A and B resolve to one library (copy them to two paths)\n");
        return 2;
    }
    const int nb = n / 256;
    const size_t wbytes = (size_t)(nc / 8) * nb * Q4_KX8;
    const size_t abytes = gemv ? (size_t) nr * nb * Q8_K : (size_t)(nr / 4) * nb * Q8_KX4;
    uint8_t * w = malloc(wbytes), * a = malloc(abytes);
    float * sa = malloc(sizeof(float) * nr * nc), * sb = malloc(sizeof(float) * nr * nc);
    double * ta = malloc(sizeof(double) * reps), * tb = malloc(sizeof(double) * reps);
    srand(1);
    for (size_t i = 0; i < wbytes; i++) w[i] = (uint8_t) rand();
    for (size_t i = 0; i < abytes; i++) a[i] = (uint8_t) rand();
    for (size_t blk = 0; blk < wbytes / Q4_KX8; blk++) {   // d, dmin: 16 small positive halves
        uint16_t * d = (uint16_t *)(w + blk * Q4_KX8);
        for (int j = 0; j < 16; j++) d[j] = (uint16_t)(0x2000 + (rand() & 0x3ff));
    }
    const size_t step = gemv ? Q8_K : Q8_KX4;
    for (size_t blk = 0; blk < abytes / step; blk++) {
        float * d = (float *)(a + blk * step);
        for (int j = 0; j < (gemv ? 1 : 4); j++) d[j] = 0.01f * (float)(1 + rand() % 100);
        if (gemv) sums(a + blk * step + 4 + 256, 16);
        else sums(a + blk * step + 16 + 1024, 64);
    }
    for (int r = 0; r < reps; r++) {
        const double t0 = now_s();
        if (gemv) ((gemv_fn) fa)(n, sa, nc, w, a, (size_t) nb * Q8_K, nr, nc);
        else ((gemm_fn) fa)(n, sa, nc, w, a, nr, nc);
        const double t1 = now_s();
        if (gemv) ((gemv_fn) fb)(n, sb, nc, w, a, (size_t) nb * Q8_K, nr, nc);
        else ((gemm_fn) fb)(n, sb, nc, w, a, nr, nc);
        ta[r] = t1 - t0;
        tb[r] = now_s() - t1;
    }
    const int same = memcmp(sa, sb, sizeof(float) * nr * nc) == 0;
    qsort(ta, reps, sizeof(double), by_value);
    qsort(tb, reps, sizeof(double), by_value);
    printf("%s K=%d N=%d rows=%d: A %.3f ms (median %.3f), B %.3f ms (median %.3f), B/A %.3f "
           "(median %.3f); outputs %s\n", argv[3], n, nc, nr, ta[0] * 1e3, ta[reps / 2] * 1e3,
           tb[0] * 1e3, tb[reps / 2] * 1e3, tb[0] / ta[0], tb[reps / 2] / ta[reps / 2],
           same ? "identical" : "DIFFER");
    return 0;
}
