/* What loading dpar costs a process that never uses a GPU: start-up time and resident memory of a fresh process that
 * loads libdpar and creates an engine over 2 CPU devices (a small MLP), measured from outside over many runs.
 *
 *   bench_startup [--runs N] <libdpar.so.0> [more libdpar.so.0 to compare...]
 *
 * For each library, N runs (default 40) of this program as a child that dlopen()s it, builds the model and engine,
 * frees them and exits; the runs of the libraries are interleaved, so that a change of load on the machine hits all
 * alike. Printed per library: the median and fastest wall time from fork to exit, the median peak resident set
 * (ru_maxrss of wait4), and the CUDA libraries the child had mapped once the engine existed (/proc/self/maps): the
 * ones the library pinned at load. A library built without CUDA is the floor that loading the CUDA runtime on first
 * use could at best reach (bench/results/guest_startup_2026-11-29.md). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "dpar_api.h"

/* The child: load, create an engine, report the CUDA libraries mapped, exit. */
static int child(const char *path, int report) {
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) return fprintf(stderr, "dlopen %s: %s\n", path, dlerror()), 1;
  dpar_get_api_fn get_api;
  *(void **)(&get_api) = dlsym(lib, "dpar_get_api");
  const dpar_api_v1 *dp = get_api ? (const dpar_api_v1 *)get_api(DPAR_API_TABLE_VERSION) : NULL;
  if (!dp) return fprintf(stderr, "%s: no function table\n", path), 1;
  dpar_model *model = NULL;
  dpar_engine *engine = NULL;
  dpar_optimizer_options opt;
  dpar_engine_options eo;
  if (dp->dpar_model_create(&model, NULL) || dp->dpar_model_add_linear(model, 64, 128, 1) ||
      dp->dpar_model_add_activation(model, DPAR_RELU) || dp->dpar_model_add_linear(model, 128, 10, 1) ||
      dp->dpar_optimizer_options_init_sized(&opt, sizeof opt) || dp->dpar_engine_options_init_sized(&eo, sizeof eo))
    return fprintf(stderr, "%s\n", dp->dpar_last_error()), 1;
  eo.num_cpu_devices = 2;
  if (dp->dpar_engine_create(&engine, model, &opt, &eo)) return fprintf(stderr, "%s\n", dp->dpar_last_error()), 1;
  if (report) {
    FILE *maps = fopen("/proc/self/maps", "r");
    char line[4096], seen[4096] = "";
    while (maps && fgets(line, sizeof line, maps)) {
      char *file = strrchr(line, '/');
      if (!file || (!strstr(file, "libcu") && !strstr(file, "libnccl"))) continue;
      file[strcspn(file, "\n")] = '\0';
      if (strstr(seen, file + 1)) continue;
      if (strlen(seen) + strlen(file) + 2 < sizeof seen) strcat(strcat(seen, " "), file + 1);
    }
    if (maps) fclose(maps);
    printf("%36s CUDA libraries mapped: %s\n", "", seen[0] ? seen + 1 : "none");
  }
  dp->dpar_engine_free(engine);
  dp->dpar_model_free(model);
  return 0;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int compare(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* One run of the child for `path`: wall seconds and peak resident KiB; 0 on success. */
static int run(const char *self, const char *path, double *seconds, long *kib) {
  const double start = now();
  const pid_t pid = fork();
  if (pid < 0) return perror("fork"), 1;
  if (pid == 0) {
    execl(self, self, "--child", path, (char *)NULL);
    _exit(127);
  }
  int status = 0;
  struct rusage usage;
  if (wait4(pid, &status, 0, &usage) != pid) return perror("wait4"), 1;
  *seconds = now() - start;
  *kib = usage.ru_maxrss;
  return !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "--child") == 0) return child(argv[2], 0);
  if (argc == 3 && strcmp(argv[1], "--maps") == 0) return child(argv[2], 1);
  int runs = 40, first = 1;
  if (argc > 2 && strcmp(argv[1], "--runs") == 0) runs = atoi(argv[2]), first = 3;
  if (first >= argc || runs < 1) {
    fprintf(stderr, "usage: bench_startup [--runs N] <libdpar.so.0> [more...]\n");
    return 2;
  }
  const int libs = argc - first;
  double *seconds = calloc((size_t)(libs * runs), sizeof *seconds);
  double *kib = calloc((size_t)(libs * runs), sizeof *kib);
  if (!seconds || !kib) return 1;
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return perror("readlink /proc/self/exe"), 1;
  self[n] = '\0';
  for (int r = 0; r < runs; ++r)
    for (int l = 0; l < libs; ++l) {
      long k = 0;
      if (run(self, argv[first + l], &seconds[l * runs + r], &k))
        return fprintf(stderr, "the child for %s failed\n", argv[first + l]), 1;
      kib[l * runs + r] = (double)k;
    }
  printf("%d runs each, interleaved: a process that loads dpar and creates an engine over 2 CPU devices\n", runs);
  printf("%-10s %-10s %-12s  %s\n", "median s", "fastest s", "median MiB", "library; CUDA libraries mapped");
  for (int l = 0; l < libs; ++l) {
    qsort(&seconds[l * runs], (size_t)runs, sizeof *seconds, compare);
    qsort(&kib[l * runs], (size_t)runs, sizeof *kib, compare);
    printf("%-10.4f %-10.4f %-12.1f  %s\n", seconds[l * runs + runs / 2], seconds[l * runs],
           kib[l * runs + runs / 2] / 1024.0, argv[first + l]);
    fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
      execl(self, self, "--maps", argv[first + l], (char *)NULL);
      _exit(127);
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return 1;
  }
  return 0;
}
