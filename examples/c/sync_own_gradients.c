/* A framework with its own tensors and autograd uses dpar only to synchronise gradients, as DDP's reducer does.
 *
 * Four threads train one two-layer network y = W2 tanh(W1 x + b1) + b2 data-parallel. Each computes, with its own
 * code, the gradient of the mean squared error on its quarter of the batch, and tells dpar each gradient buffer is
 * ready as soon as its backward has produced it (W2 and b2 first, then W1 and b1): dpar_reducer_grad_ready() hands
 * the finished buckets to the communication thread while the backward goes on, and dpar_reducer_wait() returns
 * when every buffer holds the average over the threads. Then each thread applies the same SGD step.
 * The result is compared with one thread training on the whole batch. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dpar.h"

enum { kThreads = 4, kIn = 8, kHidden = 16, kRows = 64, kSteps = 200 };
static const float kLr = 0.05f;
static float X[kRows][kIn], Y[kRows];

#define CHECK(call)                                                                         \
  do {                                                                                      \
    dpar_status s_ = (call);                                                                \
    if (s_ != DPAR_OK) {                                                                    \
      fprintf(stderr, "%s failed: %s: %s\n", #call, dpar_status_str(s_), dpar_last_error()); \
      exit(1);                                                                              \
    }                                                                                       \
  } while (0)

/* The framework's parameters and gradients: four separate buffers, registered with the reducer in forward order. */
typedef struct net {
  float w1[kHidden][kIn], b1[kHidden], w2[kHidden], b2[1];
} net;
enum { kW1, kB1, kW2, kB2, kBuffers };

static float *buffer(net *n, int i) {
  float *p[kBuffers] = {&n->w1[0][0], n->b1, n->w2, n->b2};
  return p[i];
}
static const size_t kCounts[kBuffers] = {kHidden * kIn, kHidden, kHidden, 1};

/* The framework's forward for row i: the output, and the hidden activations in h. */
static float forward(const net *p, int i, float *h) {
  float y = p->b2[0];
  for (int j = 0; j < kHidden; ++j) {
    float a = p->b1[j];
    for (int f = 0; f < kIn; ++f) a += p->w1[j][f] * X[i][f];
    h[j] = tanhf(a);
    y += p->w2[j] * h[j];
  }
  return y;
}

/* The framework's autograd: forward and backward of the mean squared error over rows [begin, end). `ready` is its
 * backward hook, called as each gradient is final. */
static void backward(net *grad, const net *p, int begin, int end, void (*ready)(void *, int), void *hook) {
  memset(grad, 0, sizeof *grad);
  float h[kRows][kHidden], dy[kRows];
  const float scale = 2.0f / (float)(end - begin);
  for (int i = begin; i < end; ++i) dy[i] = scale * (forward(p, i, h[i]) - Y[i]);
  for (int i = begin; i < end; ++i) { /* the last layer first */
    for (int j = 0; j < kHidden; ++j) grad->w2[j] += dy[i] * h[i][j];
    grad->b2[0] += dy[i];
  }
  ready(hook, kW2);
  ready(hook, kB2);
  for (int i = begin; i < end; ++i)
    for (int j = 0; j < kHidden; ++j) {
      const float da = dy[i] * p->w2[j] * (1.0f - h[i][j] * h[i][j]);
      for (int f = 0; f < kIn; ++f) grad->w1[j][f] += da * X[i][f];
      grad->b1[j] += da;
    }
  ready(hook, kW1);
  ready(hook, kB1);
}

static void sgd(net *p, const net *g) {
  for (int i = 0; i < kBuffers; ++i)
    for (size_t k = 0; k < kCounts[i]; ++k) buffer(p, i)[k] -= kLr * buffer((net *)g, i)[k];
}

static void mark_ready(void *reducer, int index) { CHECK(dpar_reducer_grad_ready(reducer, (size_t)index)); }
static void no_hook(void *unused, int index) { (void)unused, (void)index; }

struct worker {
  dpar_comm *comm;
  size_t rank;
  net params, grads;
};

static void *train(void *arg) {
  struct worker *w = arg;
  const int rows = kRows / kThreads, begin = (int)w->rank * rows;
  float *grads[kBuffers];
  for (int i = 0; i < kBuffers; ++i) grads[i] = buffer(&w->grads, i);
  dpar_reducer_options opts = DPAR_REDUCER_OPTIONS_INIT; /* the mean over the threads */
  opts.first_bucket_bytes = 64;                           /* W2 and b2 go out first, while W1 is computed */
  dpar_reducer *reducer = NULL;
  CHECK(dpar_reducer_create(&reducer, w->comm, grads, kCounts, kBuffers, &opts));
  for (int step = 0; step < kSteps; ++step) {
    backward(&w->grads, &w->params, begin, begin + rows, mark_ready, reducer);
    CHECK(dpar_reducer_wait(reducer));
    sgd(&w->params, &w->grads);
  }
  dpar_reducer_free(reducer);
  return NULL;
}

static void init(net *p) {
  srand(7);
  for (int j = 0; j < kHidden; ++j) {
    for (int f = 0; f < kIn; ++f) p->w1[j][f] = ((float)rand() / (float)RAND_MAX - 0.5f) * 0.7f;
    p->b1[j] = 0.0f;
    p->w2[j] = ((float)rand() / (float)RAND_MAX - 0.5f) * 0.5f;
  }
  p->b2[0] = 0.0f;
}

int main(void) {
  srand(1);
  for (int i = 0; i < kRows; ++i) {
    Y[i] = 0.5f;
    for (int f = 0; f < kIn; ++f) {
      X[i][f] = (float)rand() / (float)RAND_MAX - 0.5f;
      Y[i] += (float)(f + 1) * 0.1f * X[i][f];
    }
  }

  dpar_comm_options opts = DPAR_COMM_OPTIONS_INIT;
  opts.timeout_seconds = 30;
  dpar_comm_group *group = NULL;
  CHECK(dpar_comm_group_create(&group, kThreads, &opts));
  static struct worker workers[kThreads];
  pthread_t threads[kThreads];
  for (int r = 0; r < kThreads; ++r) {
    workers[r].rank = (size_t)r;
    init(&workers[r].params);
    CHECK(dpar_comm_group_member(&workers[r].comm, group, (size_t)r));
  }
  dpar_comm_group_free(group); /* the members keep the group alive */
  for (int r = 0; r < kThreads; ++r) pthread_create(&threads[r], NULL, train, &workers[r]);
  for (int r = 0; r < kThreads; ++r) pthread_join(threads[r], NULL);

  /* The reference: one thread, the whole batch (equal chunks, so the mean of the means is the mean). */
  static net ref, grad;
  init(&ref);
  for (int step = 0; step < kSteps; ++step) {
    backward(&grad, &ref, 0, kRows, no_hook, NULL);
    sgd(&ref, &grad);
  }
  double worst = 0.0;
  for (int r = 0; r < kThreads; ++r)
    for (int i = 0; i < kBuffers; ++i)
      for (size_t k = 0; k < kCounts[i]; ++k) {
        const double a = buffer(&workers[r].params, i)[k], b = buffer(&ref, i)[k];
        const double d = fabs(a - b) / fmax(fabs(b), 1e-2);
        if (d > worst) worst = d;
      }
  /* The training itself worked: the loss fell. */
  net start;
  init(&start);
  double loss_start = 0.0, loss_end = 0.0;
  for (int i = 0; i < kRows; ++i) {
    float h[kHidden];
    const float e0 = forward(&start, i, h) - Y[i], e1 = forward(&workers[0].params, i, h) - Y[i];
    loss_start += (double)(e0 * e0) / kRows;
    loss_end += (double)(e1 * e1) / kRows;
  }
  printf("mean squared error: %.4f before, %.4f after %d steps\n", loss_start, loss_end, kSteps);
  printf("largest relative difference from single-thread full-batch training: %.2e\n", worst);
  for (int r = 0; r < kThreads; ++r) dpar_comm_free(workers[r].comm);
  return worst < 1e-5 && loss_end < 0.5 * loss_start ? 0 : 1;
}
