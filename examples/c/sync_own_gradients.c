/* A framework with its own tensors and autograd uses dpar only to synchronise gradients.
 *
 * Four threads train one linear regression model y = w.x + b data-parallel: each computes the gradient of the
 * mean squared error on its quarter of the batch with its own code, dpar averages the gradients across the
 * threads (an asynchronous all-reduce started as soon as the gradient is ready, waited for before the update),
 * and each thread applies the same SGD step. The result is compared with one thread training on the whole batch. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dpar.h"

enum { kThreads = 4, kFeatures = 8, kRows = 64, kSteps = 200 };
static const float kLr = 0.05f;
static float X[kRows][kFeatures], Y[kRows];

#define CHECK(call)                                                                         \
  do {                                                                                      \
    dpar_status s_ = (call);                                                                \
    if (s_ != DPAR_OK) {                                                                    \
      fprintf(stderr, "%s failed: %s: %s\n", #call, dpar_status_str(s_), dpar_last_error()); \
      exit(1);                                                                              \
    }                                                                                       \
  } while (0)

/* The "framework": gradient of the mean squared error over rows [begin, end) of the batch, (w, b) packed. */
static void gradient(float *grad, const float *params, int begin, int end) {
  memset(grad, 0, sizeof(float) * (kFeatures + 1));
  for (int i = begin; i < end; ++i) {
    float err = params[kFeatures];
    for (int f = 0; f < kFeatures; ++f) err += params[f] * X[i][f];
    err -= Y[i];
    for (int f = 0; f < kFeatures; ++f) grad[f] += 2.0f * err * X[i][f] / (float)(end - begin);
    grad[kFeatures] += 2.0f * err / (float)(end - begin);
  }
}

struct worker {
  dpar_comm *comm;
  int rank;
  float params[kFeatures + 1];
};

static void *train(void *arg) {
  struct worker *w = arg;
  const int rows = kRows / kThreads, begin = w->rank * rows;
  float grad[kFeatures + 1];
  for (int step = 0; step < kSteps; ++step) {
    gradient(grad, w->params, begin, begin + rows);
    dpar_work *work = NULL;
    CHECK(dpar_comm_all_reduce_async(&work, w->comm, grad, grad, kFeatures + 1, DPAR_F32, DPAR_MEAN));
    CHECK(dpar_work_wait(work)); /* a framework would overlap this with the rest of its backward */
    dpar_work_free(work);
    for (int p = 0; p <= kFeatures; ++p) w->params[p] -= kLr * grad[p];
  }
  return NULL;
}

int main(void) {
  srand(1);
  for (int i = 0; i < kRows; ++i) {
    Y[i] = 0.5f;
    for (int f = 0; f < kFeatures; ++f) {
      X[i][f] = (float)rand() / (float)RAND_MAX - 0.5f;
      Y[i] += (float)(f + 1) * 0.1f * X[i][f];
    }
  }

  dpar_comm_options opts = DPAR_COMM_OPTIONS_INIT;
  opts.timeout_seconds = 30;
  dpar_comm_group *group = NULL;
  CHECK(dpar_comm_group_create(&group, kThreads, &opts));
  struct worker workers[kThreads];
  pthread_t threads[kThreads];
  for (int r = 0; r < kThreads; ++r) {
    workers[r].rank = r;
    memset(workers[r].params, 0, sizeof workers[r].params);
    CHECK(dpar_comm_group_member(&workers[r].comm, group, r));
  }
  dpar_comm_group_free(group); /* the members keep the group alive */
  for (int r = 0; r < kThreads; ++r) pthread_create(&threads[r], NULL, train, &workers[r]);
  for (int r = 0; r < kThreads; ++r) pthread_join(threads[r], NULL);

  /* The reference: one thread, the whole batch (equal chunks, so the mean of means is the mean). */
  float ref[kFeatures + 1] = {0}, grad[kFeatures + 1];
  for (int step = 0; step < kSteps; ++step) {
    gradient(grad, ref, 0, kRows);
    for (int p = 0; p <= kFeatures; ++p) ref[p] -= kLr * grad[p];
  }
  double worst = 0.0;
  for (int r = 0; r < kThreads; ++r)
    for (int p = 0; p <= kFeatures; ++p) {
      double d = fabs((double)workers[r].params[p] - (double)ref[p]) / fmax(fabs((double)ref[p]), 1e-2);
      if (d > worst) worst = d;
    }
  printf("w[0..2] = %.4f %.4f %.4f, b = %.4f (true: 0.1 0.2 0.3, 0.5)\n", workers[0].params[0], workers[0].params[1],
         workers[0].params[2], workers[0].params[kFeatures]);
  printf("largest relative difference from single-thread full-batch training: %.2e\n", worst);
  for (int r = 0; r < kThreads; ++r) dpar_comm_free(workers[r].comm);
  return worst < 1e-5 ? 0 : 1;
}
