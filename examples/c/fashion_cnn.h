/* The small residual CNN that train_fashion_mnist_cnn trains and bench_cnn times, built through dpar.h.
 *
 * As a PyTorch module with torchvision's ResNet names (bench/torch_anchor.py's fashion_cnn is the same module):
 *   x.view(-1, 1, 28, 28) -> conv1 (1->32, 3x3, pad 1, no bias) -> bn1 -> relu -> max_pool 2x2   (32 x 14 x 14)
 *   layer1.0, a basic block: conv1 -> bn1 -> relu -> conv2 -> bn2, plus its input, relu          (32 x 14 x 14)
 *   max_pool 2x2 -> flatten -> fc (32*7*7 -> classes)
 * Its checkpoint reads as that module's state_dict: "conv1.weight", "layer1.0.bn2.running_var", "fc.bias". */
#ifndef DPAR_EXAMPLE_FASHION_CNN_H
#define DPAR_EXAMPLE_FASHION_CNN_H

#include "dpar.h"

/* Names the node just added: its parameters and buffers become NAME.weight, NAME.running_mean, ... */
static dpar_status fashion_cnn_name_last(dpar_model *model, const char *name) {
  int32_t node = 0;
  dpar_status s = dpar_model_last_node(&node, model);
  return s != DPAR_OK ? s : dpar_model_set_node_name(model, node, name);
}

/* A 3x3 convolution without bias (the BatchNorm after it has one), named CONV, then its BatchNorm, named BN. */
static dpar_status fashion_cnn_conv_bn(dpar_model *model, const char *conv, const char *bn, int64_t in, int64_t out) {
  const int64_t k3[2] = {3, 3}, pad1[2] = {1, 1};
  dpar_status s = dpar_model_add_conv2d(model, in, out, k3, NULL, pad1, NULL, 1, 0);
  if (s == DPAR_OK) s = fashion_cnn_name_last(model, conv);
  if (s == DPAR_OK) s = dpar_model_add_batchnorm2d(model, out, 1e-5f, 0.1f, 1);
  if (s == DPAR_OK) s = fashion_cnn_name_last(model, bn);
  return s;
}

/* Appends the CNN to an empty model whose inputs are rows of 784 pixels. */
static dpar_status fashion_cnn_add(dpar_model *model, int64_t classes) {
  const int64_t image[3] = {1, 28, 28}, pool2[2] = {2, 2};
  int32_t residual[2] = {0, 0};
  dpar_status s = dpar_model_add_reshape(model, image, 3);
  if (s == DPAR_OK) s = fashion_cnn_conv_bn(model, "conv1", "bn1", 1, 32);
  if (s == DPAR_OK) s = dpar_model_add_activation(model, DPAR_RELU);
  if (s == DPAR_OK) s = dpar_model_add_max_pool2d(model, pool2, NULL, NULL);
  if (s == DPAR_OK) s = dpar_model_last_node(&residual[1], model); /* the block's input: the shortcut */
  if (s == DPAR_OK) s = fashion_cnn_conv_bn(model, "layer1.0.conv1", "layer1.0.bn1", 32, 32);
  if (s == DPAR_OK) s = dpar_model_add_activation(model, DPAR_RELU);
  if (s == DPAR_OK) s = fashion_cnn_conv_bn(model, "layer1.0.conv2", "layer1.0.bn2", 32, 32);
  if (s == DPAR_OK) s = dpar_model_last_node(&residual[0], model);
  if (s == DPAR_OK) s = dpar_model_add_sum(model, residual, 2);
  if (s == DPAR_OK) s = dpar_model_add_activation(model, DPAR_RELU);
  if (s == DPAR_OK) s = dpar_model_add_max_pool2d(model, pool2, NULL, NULL);
  if (s == DPAR_OK) s = dpar_model_add_flatten(model);
  if (s == DPAR_OK) s = dpar_model_add_linear(model, 32 * 7 * 7, classes, 1);
  if (s == DPAR_OK) s = fashion_cnn_name_last(model, "fc");
  return s;
}

#endif
