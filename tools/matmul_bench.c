// One ggml_mul_mat timed through ggml-cpu, for comparing ggml-cpu libraries kernel by kernel
// (issue 44: the batch-invariant tiles against llama.cpp's own tinyBLAS on one matrix shape).
//
// Build against any library folder laid out like llama_cpp/lib (the headers are the vendored
// llama.cpp's, from the llama-cpp-python source install.sh unpacks, or any copy of the same
// version), then run it once per library, interleaved:
//
//   cc -O2 -I<llama.cpp>/ggml/include tools/matmul_bench.c -o /tmp/matmul_bench
//      -L<lib> -lggml-base -lggml-cpu -lggml       (one command line)
//   for lib in <own lib> <patched lib>; do
//       LD_LIBRARY_PATH=$lib /tmp/matmul_bench f16 576 1536 16 1 1 300; done
//
// Arguments: TYPE (f16, bf16, f32: the weights) K N M H0 H1 REPS. Weights are K x N x H0, the F32
// activations K x M x H1 (H1 a multiple of H0: heads sharing a KV head, as KQ and KQV: 64 516 16
// 3 9 and 516 64 16 3 9 are SmolLM2's with a 516-token cache). Prints the fastest and the mean
// of REPS computes in microseconds, and a checksum of the output (equal across libraries when
// their arithmetic is). Environment: NT threads (default 2); FLUSH=1 writes 64 MB between
// computes so the weights come from memory. Weights stay in cache otherwise: a kernel's compute
// cost, not a model's (tools/weight_type_cost times models). A benchmark: it asserts nothing.
#include "ggml.h"
#include "ggml-cpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char ** argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s f16|bf16|f32 K N M H0 H1 REPS\n", argv[0]);
        return 2;
    }
    const enum ggml_type type = strcmp(argv[1], "f16") == 0 ? GGML_TYPE_F16 :
                                strcmp(argv[1], "bf16") == 0 ? GGML_TYPE_BF16 : GGML_TYPE_F32;
    const int k = atoi(argv[2]), n = atoi(argv[3]), m = atoi(argv[4]);
    const int h0 = atoi(argv[5]), h1 = atoi(argv[6]), reps = atoi(argv[7]);
    const int threads = getenv("NT") ? atoi(getenv("NT")) : 2;
    if (k <= 0 || n <= 0 || m <= 0 || h0 <= 0 || h1 <= 0 || h1 % h0 != 0 || reps <= 0) {
        fprintf(stderr, "error: K N M H0 H1 REPS must be positive, H1 a multiple of H0\n");
        return 2;
    }

    struct ggml_init_params ip = { (size_t) 1 << 30, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * a = ggml_new_tensor_3d(ctx, type, k, n, h0);
    struct ggml_tensor * b = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, k, m, h1);
    const int64_t na = (int64_t) k * n * h0, nb = (int64_t) k * m * h1;
    float * w = malloc(sizeof(float) * na);
    srand(1);
    for (int64_t i = 0; i < na; i++) {
        w[i] = (rand() / (float) RAND_MAX - 0.5f) * 0.1f;
    }
    if (type == GGML_TYPE_F16) {
        ggml_fp32_to_fp16_row(w, a->data, na);
    } else if (type == GGML_TYPE_BF16) {
        ggml_fp32_to_bf16_row(w, a->data, na);
    } else {
        memcpy(a->data, w, sizeof(float) * na);
    }
    for (int64_t i = 0; i < nb; i++) {
        ((float *) b->data)[i] = rand() / (float) RAND_MAX - 0.5f;
    }
    struct ggml_tensor * c = ggml_mul_mat(ctx, a, b);
    struct ggml_cgraph * g = ggml_new_graph(ctx);
    ggml_build_forward_expand(g, c);

    char * flush = getenv("FLUSH") ? malloc((size_t) 64 << 20) : NULL;
    double best = 1e9, total = 0;
    for (int r = 0; r < reps; r++) {
        if (flush) {
            memset(flush, r, (size_t) 64 << 20);
        }
        const double t = now_s();
        ggml_graph_compute_with_ctx(ctx, g, threads);
        const double dt = now_s() - t;
        best = dt < best ? dt : best;
        total += dt;
    }
    double sum = 0;
    for (int64_t i = 0; i < (int64_t) n * m * h1; i++) {
        sum += ((float *) c->data)[i];
    }
    printf("%s K%d N%d M%d H%d/%d threads %d best %.1f us mean %.1f us (check %.9g)\n",
           argv[1], k, n, m, h0, h1, threads, best * 1e6, total / reps * 1e6, sum);
    free(w);
    free(flush);
    ggml_free(ctx);
    return 0;
}
