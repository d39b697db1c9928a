/**
 * @file dpar/model.h
 * @brief Models: the graph of layers that an engine copies to every device.
 * Part of dpar.h, which includes every topic's header and is the one to include; this one also compiles alone.
 */
#ifndef DPAR_MODEL_H
#define DPAR_MODEL_H

#include "common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------------------------ */
/** @name Models
 * A model is a graph of nodes built append-only on the host: the template that an engine copies once to every
 * device. Nodes are numbered 0, 1, ... in the order they are added. Each dpar_model_add_*() call appends one node
 * that reads the previous node's output (the model input, ::DPAR_MODEL_INPUT, for the first), or the node that
 * dpar_model_branch_from() chose; dpar_model_add_sum() and dpar_model_add_concat() read the nodes they name. A
 * model built with add calls only is therefore a sequential model. The model's output is the last node; every
 * other node must be read by a later one. A node with several readers gets the sum of their gradients.
 * A model handle is not thread-safe. Freeing a model does not affect engines created from it. */
/**@{*/
typedef struct dpar_model dpar_model; /**< An opaque model graph. */

/** @brief The model's input, where a node id is expected (dpar_model_branch_from(), dpar_model_add_sum()). */
#define DPAR_MODEL_INPUT (-1)

/** @brief Options for dpar_model_create(). */
typedef struct dpar_model_options {
  size_t size;      /**< sizeof(dpar_model_options) as the caller compiled it. */
  uint32_t version; /**< #DPAR_MODEL_OPTIONS_VERSION. */
  uint64_t seed;    /**< Seed of parameter initialisation. Default 0. */
} dpar_model_options;
#define DPAR_MODEL_OPTIONS_VERSION 1
#define DPAR_MODEL_OPTIONS_INIT {sizeof(dpar_model_options), DPAR_MODEL_OPTIONS_VERSION, 0}
/**
 * @brief Fills @p opts with defaults: the layout of @p size bytes, sizeof(dpar_model_options) as the caller compiled
 * it, and no byte past it. ::DPAR_ERR_NOT_SUPPORTED for a layout newer than the library's. Call it as
 * dpar_model_options_init().
 */
DPAR_API dpar_status dpar_model_options_init_sized(dpar_model_options *opts, size_t size);
/**
 * @brief Fills @p opts with defaults: a macro that passes the caller's sizeof to dpar_model_options_init_sized(), so
 * that a newer libdpar writes the caller's layout. The function of this name, which programs built against dpar.h 0.4
 * and older call, writes dpar.h 0.4's layout; a table of functions (dpar_api.h) or a binding without C macros calls
 * the _sized one.
 */
DPAR_API dpar_status dpar_model_options_init(dpar_model_options *opts);
#define dpar_model_options_init(opts) dpar_model_options_init_sized((opts), sizeof(dpar_model_options))

/**
 * @brief Creates an empty model.
 * @param[out] out  The model, owned by the caller (dpar_model_free()).
 * @param opts      Options, or NULL for defaults.
 */
DPAR_API dpar_status dpar_model_create(dpar_model **out, const dpar_model_options *opts);
/** @brief Frees a model (NULL is a no-op). */
DPAR_API void dpar_model_free(dpar_model *model);

/**
 * @brief Appends a fully connected layer y = x W^T + b, with W (out_features, in_features) and b (out_features),
 * initialised as PyTorch's nn.Linear does (uniform in +-1/sqrt(in_features)) from the model's seed. It takes
 * (batch, ..., in_features) and gives (batch, ..., out_features), as nn.Linear does.
 * @param has_bias  Nonzero for a bias.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a zero size.
 */
DPAR_API dpar_status dpar_model_add_linear(dpar_model *model, int64_t in_features, int64_t out_features,
                                           int32_t has_bias);

/** @brief Elementwise activations. */
typedef enum dpar_activation {
  DPAR_RELU = 0,    /**< max(x, 0). */
  DPAR_GELU = 1,    /**< x * Phi(x), exact (erf) form, as PyTorch's default. */
  DPAR_TANH = 2,    /**< tanh(x). */
  DPAR_SIGMOID = 3, /**< 1 / (1 + exp(-x)). */
  DPAR_SILU = 4     /**< x * sigmoid(x) (SiLU, swish), as PyTorch's nn.SiLU. */
} dpar_activation;
/** @brief Appends an activation (a ::dpar_activation). */
DPAR_API dpar_status dpar_model_add_activation(dpar_model *model, int32_t activation);
/**
 * @brief Appends BatchNorm1d over the channels C = @p num_features of a (B, C) or (B, C, L) input, as
 * torch.nn.BatchNorm1d. Training mode normalises with the batch's mean and biased variance per channel and moves the
 * buffers running_mean and running_var toward the mean and the unbiased variance by @p momentum (and counts
 * num_batches_tracked); eval mode (dpar_engine_set_training()) normalises with running_mean and running_var.
 * With @p affine, a weight (ones) and a bias (zeros) per channel follow. On several devices each replica normalises
 * over its own chunk of the batch (as DataParallel and DistributedDataParallel); after every training-mode call every
 * replica's buffers are those of replica 0 of rank 0. CPU and CUDA devices run it (statistics in double on both).
 * @param eps       Added to the variance; positive (PyTorch's default 1e-5).
 * @param momentum  In [0, 1] (PyTorch's default 0.1; its momentum=None is not supported).
 * @param affine    Nonzero for the weight and bias.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a bad size, eps or momentum.
 */
DPAR_API dpar_status dpar_model_add_batchnorm1d(dpar_model *model, int64_t num_features, float eps, float momentum,
                                                int32_t affine);
/** @brief Appends BatchNorm2d over the channels of a (B, C, H, W) input, as torch.nn.BatchNorm2d; otherwise as
 * dpar_model_add_batchnorm1d(). */
DPAR_API dpar_status dpar_model_add_batchnorm2d(dpar_model *model, int64_t num_features, float eps, float momentum,
                                                int32_t affine);
/**
 * @brief Appends SyncBatchNorm over the channels of a (B, C), (B, C, L) or (B, C, H, W) input, as
 * torch.nn.SyncBatchNorm: in training mode the per-channel statistics (and, in backward, the sums the input's
 * gradient needs) are summed over every replica of every process of the engine, so that N devices train as one
 * device on the whole batch, also with uneven chunks or replicas given no rows. Outside an engine it is BatchNorm.
 * Arguments as dpar_model_add_batchnorm1d().
 */
DPAR_API dpar_status dpar_model_add_sync_batchnorm(dpar_model *model, int64_t num_features, float eps,
                                                   float momentum, int32_t affine);
/** @brief Turns every BatchNorm1d/2d layer of the model into SyncBatchNorm, keeping its parameters and buffers (as
 * torch.nn.SyncBatchNorm.convert_sync_batchnorm). */
DPAR_API dpar_status dpar_model_convert_sync_batchnorm(dpar_model *model);
/**
 * @brief Appends LayerNorm over the last dim of a (B, ..., D) input, D = @p normalized_size, as
 * torch.nn.LayerNorm((D,), eps, elementwise_affine): each row of D values is normalised with its own mean and biased
 * variance (in double), then, with @p elementwise_affine, scaled by "weight" (D, ones) and shifted by "bias" (D,
 * zeros). Rows are independent, so N devices train as one. CPU and CUDA devices run it.
 * @param eps                 Added to the variance; positive (PyTorch's default 1e-5).
 * @param elementwise_affine  Nonzero for the weight and bias.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a null model, a size outside 1 to 2^24 or a bad eps.
 */
DPAR_API dpar_status dpar_model_add_layernorm(dpar_model *model, int64_t normalized_size, float eps,
                                              int32_t elementwise_affine);
/**
 * @brief Appends an Embedding, as torch.nn.Embedding(num_embeddings, embedding_dim): int32 indices (B) or (B, T)
 * in [0, num_embeddings) give rows of "weight" (num_embeddings, embedding_dim), initialised from N(0, 1): output
 * (B, E) or (B, T, E). A model whose input this layer reads takes an int32 input tensor (every node reading the
 * input must then be an Embedding); the engine checks every index on the host before a step and refuses one out of
 * range with ::DPAR_ERR_INVALID_ARGUMENT naming the index and its position, changing nothing. The weight's gradient
 * is dense (zero in the rows no index named) and is all-reduced as any parameter. No max_norm or sparse gradient
 * (padding_idx: dpar_model_add_embedding_padded()). CPU and CUDA devices run it.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a null model, a size outside 1 to 2^24, or where the layer
 * would read a node's (float) output instead of the model's input (after dpar_model_branch_from(model,
 * ::DPAR_MODEL_INPUT) it reads the input).
 */
DPAR_API dpar_status dpar_model_add_embedding(dpar_model *model, int64_t num_embeddings, int64_t embedding_dim);
/**
 * @brief Appends an Embedding with a padding row, as torch.nn.Embedding(num_embeddings, embedding_dim,
 * padding_idx): as dpar_model_add_embedding(), but row @p padding_idx of the weight starts at zero and never gets a
 * gradient (an index equal to it still reads the row).
 * @param padding_idx  In [-num_embeddings, num_embeddings); a negative one counts from the end, as PyTorch's.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a null model, a size outside 1 to 2^24 or a padding_idx out of
 * range.
 */
DPAR_API dpar_status dpar_model_add_embedding_padded(dpar_model *model, int64_t num_embeddings,
                                                     int64_t embedding_dim, int64_t padding_idx);

/**
 * @brief Appends GPT-2's learned position embedding (nanoGPT's wpe, added to the token embedding): a (B, T, C) input
 * gives input + weight[t] at position t, with "weight" (max_positions, C = @p embedding_dim) initialised from N(0, 1)
 * as the nn.Embedding nanoGPT holds it in. Its gradient is the sum over the batch at each position (zero in the rows
 * past T). A sequence longer than @p max_positions is refused with ::DPAR_ERR_INVALID_ARGUMENT naming both, before
 * anything changes. CPU and CUDA devices run it.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a null model or a size outside 1 to 2^24.
 */
DPAR_API dpar_status dpar_model_add_position_embedding(dpar_model *model, int64_t max_positions,
                                                       int64_t embedding_dim);
/**
 * @brief Appends scaled dot-product attention, as PyTorch's F.scaled_dot_product_attention(q, k, v, dropout_p,
 * is_causal, scale) over @p num_heads heads: q (B, L, C), k and v (B, S, C), C = num_heads x D, each viewed as (B,
 * num_heads, L or S, D) (head h is channels [hD, (h+1)D)), the output (B, L, C) with the heads merged back, as
 * nanoGPT's y.transpose(1, 2).view(B, T, C). Softmax of q k^T x scale (default 1/sqrt(D)) over the keys, with
 * @p is_causal query i sees keys j <= i only; in training mode the weights then go through dropout with
 * probability @p dropout_p (drawn from the replica's stream as dpar_model_add_dropout()'s; identity in eval mode).
 * No parameters. On the CPU a fused kernel keeps one value per query and head for backward (never the L x S weights);
 * on CUDA devices cuBLAS's batched GEMMs around dpar's softmax kernels (f32).
 * @param inputs     Three node ids (q, k, v; ::DPAR_MODEL_INPUT allowed; one may repeat) with @p n = 3; or one node
 *                   id with @p n = 1: a packed (B, T, 3C) projection read as q | k | v along its last dimension
 *                   (nanoGPT's c_attn(x).split(C, dim=2)), without copies; or NULL with @p n = 0: the next input
 *                   (the last node, or dpar_model_branch_from()'s) as a packed projection. Copied.
 * @param num_heads  1 to 65536; must divide C (checked when the input shape is known).
 * @param is_causal  Nonzero for the causal mask (then L must equal S).
 * @param dropout_p  In [0, 1).
 * @param scale      The scores' factor, positive, or 0 for 1/sqrt(D) (PyTorch's scale=None).
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT naming the first value out of range. Shapes that disagree (q, k, v
 *         of other batches or channels, heads that do not divide the channels, a causal L != S) are refused, naming
 *         them, when an engine or a step first meets the input shape.
 */
DPAR_API dpar_status dpar_model_add_attention(dpar_model *model, const int32_t *inputs, size_t n, int64_t num_heads,
                                              int32_t is_causal, float dropout_p, float scale);
/**
 * @brief Appends self-attention as torch.nn.MultiheadAttention(embed_dim, num_heads, dropout, bias,
 * batch_first=True) computes module(x, x, x, need_weights=False, is_causal=...)[0] on a (B, T, embed_dim) input: one
 * node with that module's parameters and names, "in_proj_weight" (3E, E), "in_proj_bias" (3E), "out_proj.weight"
 * (E, E), "out_proj.bias" (E) (no biases without @p has_bias), initialised as the module's (xavier_uniform_ on
 * in_proj_weight, nn.Linear's on out_proj.weight, zero biases).
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for an embed_dim outside 1 to 65536, heads that do not divide it, or
 *         a dropout outside [0, 1).
 */
DPAR_API dpar_status dpar_model_add_multihead_attention(dpar_model *model, int64_t embed_dim, int64_t num_heads,
                                                        float dropout_p, int32_t has_bias, int32_t is_causal);
/**
 * @brief Appends nanoGPT's CausalSelfAttention on the next input x (B, T, n_embd): c_attn = Linear(n_embd,
 * 3 n_embd), causal attention of @p n_head heads on its packed q|k|v (attention dropout @p dropout_p), c_proj =
 * Linear(n_embd, n_embd), and resid_dropout (@p dropout_p; no node for 0). With @p name ("transformer.h.0.attn")
 * the linear nodes are named "<name>.c_attn" and "<name>.c_proj", so their parameters have nanoGPT's state_dict
 * keys. All or nothing: a refusal leaves the model as it was.
 * @param has_bias  Nonzero for the linear layers' biases (nanoGPT's bias=True).
 * @param name      A node name prefix (as dpar_model_set_node_name() takes), or NULL for the default names.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT naming the first value out of range or the name that is taken.
 */
DPAR_API dpar_status dpar_model_add_causal_self_attention(dpar_model *model, int64_t n_embd, int64_t n_head,
                                                          float dropout_p, int32_t has_bias, const char *name);

/**
 * @brief Appends dropout with drop probability @p p in [0, 1). In training mode each replica draws its mask from
 * its own RNG stream (seeded from the engine seed and the replica index), which persists across steps (and is
 * saved in checkpoints, restored into an engine with as many replicas); in eval mode it is
 * the identity. Kept values are scaled by 1/(1-p), as in PyTorch.
 */
DPAR_API dpar_status dpar_model_add_dropout(dpar_model *model, float p);

/**
 * @brief The id of the last node added (the model's output): nodes are numbered 0, 1, ... in the order they are
 * added, as layer indices always were; ::DPAR_MODEL_INPUT for an empty model.
 * @param[out] out  The node id.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a NULL argument.
 */
DPAR_API dpar_status dpar_model_last_node(int32_t *out, const dpar_model *model);
/**
 * @brief Makes the next node added without explicit inputs read @p node's output instead of the last node's
 * (a residual block's second path, say). It holds until a node is added; that node then becomes the next input.
 * @param node  An added node, or ::DPAR_MODEL_INPUT for the model's input.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a node not yet added.
 */
DPAR_API dpar_status dpar_model_branch_from(dpar_model *model, int32_t node);
/**
 * @brief Names a node, as a PyTorch module path ("layer1.0.conv1"): its parameters become "<name>.weight" and so
 * on, the names dpar_model_param_name() and checkpoints use (a parameter it reads through dpar_model_tie_param()
 * keeps its source's name; the checkpoint key it is also saved under becomes "<name>.<param>"). A node's default name is its index ("0", so that a
 * sequential model's parameters are "0.weight", "2.weight", as nn.Sequential's).
 * @param name  Identifiers of letters, digits and '_', separated by single dots; unique in the model; a name of
 *              digits only is reserved for the node of that index; a name whose first identifier is "optimizer" is
 *              reserved for the optimizer's state in checkpoints ("optimizer.exp_avg.0.weight"). Copied.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a bad node, an empty, malformed, reserved or taken name, or one
 *         that would give a parameter or buffer the name another one has (every checkpoint key is unique, checked
 *         here, not when the checkpoint is written).
 */
DPAR_API dpar_status dpar_model_set_node_name(dpar_model *model, int32_t node, const char *name);
/**
 * @brief Ties a parameter of @p node to one of @p source_node, as PyTorch's `lm_head.weight = wte.weight` (GPT-2's
 * output projection reads the token embedding): from then on both nodes read one parameter, the source's, with the
 * source's values and name. The model holds it once: dpar_model_num_params() and dpar_model_num_param_elements()
 * count it once (as PyTorch's parameters()), the node's own copy leaves the model (the parameters after it move
 * down one index), and an engine reduces and steps it once. Its gradient is the sum of both nodes' contributions,
 * gradient accumulation included. Checkpoints hold it under both keys, "<source name>.<source_param>" and
 * "<node name>.<param>", as PyTorch's state_dict() does (both follow dpar_model_set_node_name()); loading reads the
 * source's key and refuses a file whose other key holds a different tensor (a file without it loads). The
 * optimizer's state is saved under the source's key alone. A parameter may be the source of several ties.
 * @param node          The node whose parameter is replaced: a layer node added before.
 * @param param         Its parameter's name ("weight"); copied.
 * @param source_node   The node whose parameter both read, another layer node (before or after @p node).
 * @param source_param  Its parameter's name ("weight"); copied. Where that parameter is itself tied to a third node's,
 *                      @p node reads that one.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT naming what does not fit, with nothing changed: a NULL argument, a
 *         node that is not in the model, a name that is not one of the node's parameters, a node tied to itself,
 *         shapes that differ, a parameter of @p node tied already (either way), or a source parameter @p node
 *         reads already.
 */
DPAR_API dpar_status dpar_model_tie_param(dpar_model *model, int32_t node, const char *param, int32_t source_node,
                                          const char *source_param);
/**
 * @brief Appends the elementwise sum of @p n >= 2 nodes of equal output shape (a residual connection).
 * @param inputs  Node ids (added nodes or ::DPAR_MODEL_INPUT; one may appear twice); copied.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for fewer than 2 inputs or a node not yet added. Unequal shapes are
 *         refused when an input shape is first known (engine calls), naming the nodes.
 */
DPAR_API dpar_status dpar_model_add_sum(dpar_model *model, const int32_t *inputs, size_t n);
/**
 * @brief Appends the concatenation of @p n >= 2 nodes along dim 1 (channels, as torch.cat(dim=1)); their shapes
 * must be equal but for dim 1.
 * @param inputs  Node ids (added nodes or ::DPAR_MODEL_INPUT); copied.
 * @return As dpar_model_add_sum().
 */
DPAR_API dpar_status dpar_model_add_concat(dpar_model *model, const int32_t *inputs, size_t n);
/**
 * @brief Appends a flatten, (B, ...) -> (B, prod(...)), as nn.Flatten(): a view of its input's memory, forward and
 * backward, with no copy.
 */
DPAR_API dpar_status dpar_model_add_flatten(dpar_model *model);
/**
 * @brief Appends a reshape of every row, (B, ...) -> (B, row_shape...), as nn.Unflatten(1, row_shape): a view, no
 * copy. The row's element count must be unchanged (checked when the input shape is known).
 * @param row_shape  @p ndim extents, each >= 1; copied.
 * @param ndim       1 to #DPAR_MAX_DIMS - 1 (the batch dimension comes first).
 */
DPAR_API dpar_status dpar_model_add_reshape(dpar_model *model, const int64_t *row_shape, size_t ndim);

/**
 * @brief Appends a 2-D convolution, as PyTorch's nn.Conv2d: (N, in_channels, H, W) -> (N, out_channels, OH, OW)
 * with OH = floor((H + 2 padding[0] - dilation[0] (kernel_size[0] - 1) - 1) / stride[0]) + 1 (OW likewise), zero
 * padding. Parameters "weight" (out_channels, in_channels / groups, kernel_size[0], kernel_size[1]) and, with
 * @p has_bias, "bias" (out_channels), initialised as PyTorch's (uniform in +-1/sqrt(fan_in), fan_in = in_channels /
 * groups * kernel_size[0] * kernel_size[1]) from the model's seed. Runs on CPU devices (oneDNN) and CUDA devices
 * (cuDNN 9, loaded on first use, FP32, deterministic algorithms); where cuDNN cannot be loaded, or on a device whose
 * backend has no convolution, the first forward fails with ::DPAR_ERR_NOT_SUPPORTED naming what is missing.
 * @param kernel_size  (height, width), each >= 1; not NULL.
 * @param stride       (height, width), each >= 1; NULL for (1, 1).
 * @param padding      (height, width), each >= 0; NULL for (0, 0).
 * @param dilation     (height, width), each >= 1; NULL for (1, 1).
 * @param groups       >= 1, dividing both channel counts (groups == in_channels == out_channels: depthwise).
 * @param has_bias     Nonzero for a bias.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT naming the first value out of range (an input that does not fit,
 *         such as a wrong channel count or an image smaller than the kernel, is refused when an engine or a step
 *         meets it).
 */
DPAR_API dpar_status dpar_model_add_conv2d(dpar_model *model, int64_t in_channels, int64_t out_channels,
                                           const int64_t kernel_size[2], const int64_t stride[2],
                                           const int64_t padding[2], const int64_t dilation[2], int64_t groups,
                                           int32_t has_bias);
/**
 * @brief Appends a 2-D max pooling, as PyTorch's nn.MaxPool2d (dilation 1, ceil_mode False): (N, C, H, W) -> (N, C,
 * OH, OW), OH = floor((H + 2 padding[0] - kernel_size[0]) / stride[0]) + 1. Padding never wins a maximum; each
 * window's gradient goes to its first maximum in row-major order, as PyTorch's. No parameters.
 * @param kernel_size  (height, width), each >= 1; not NULL.
 * @param stride       (height, width), each >= 1; NULL for kernel_size.
 * @param padding      (height, width), each at most half the kernel's; NULL for (0, 0).
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT naming the first value out of range.
 */
DPAR_API dpar_status dpar_model_add_max_pool2d(dpar_model *model, const int64_t kernel_size[2],
                                               const int64_t stride[2], const int64_t padding[2]);
/**
 * @brief Appends a 2-D average pooling, as PyTorch's nn.AvgPool2d with its defaults (ceil_mode False,
 * count_include_pad True: every window divides by kernel_size[0] * kernel_size[1], padding included). Arguments
 * and output size as dpar_model_add_max_pool2d(). No parameters.
 */
DPAR_API dpar_status dpar_model_add_avg_pool2d(dpar_model *model, const int64_t kernel_size[2],
                                               const int64_t stride[2], const int64_t padding[2]);
/**
 * @brief Appends an adaptive average pooling to (@p output_h, @p output_w), as PyTorch's nn.AdaptiveAvgPool2d:
 * (N, C, H, W) -> (N, C, output_h, output_w). Only (1, 1), the global average, is implemented.
 * @return ::DPAR_OK; ::DPAR_ERR_NOT_SUPPORTED for any other output size (saying so);
 *         ::DPAR_ERR_INVALID_ARGUMENT for a size below 1.
 */
DPAR_API dpar_status dpar_model_add_adaptive_avg_pool2d(dpar_model *model, int64_t output_h, int64_t output_w);

/** @brief The number of nodes (layers, joins and views). */
DPAR_API dpar_status dpar_model_num_layers(size_t *out, const dpar_model *model);
/** @brief The number of parameter tensors (PyTorch's len(list(model.parameters()))). */
DPAR_API dpar_status dpar_model_num_params(size_t *out, const dpar_model *model);
/** @brief The total number of parameter elements. */
DPAR_API dpar_status dpar_model_num_param_elements(size_t *out, const dpar_model *model);
/**
 * @brief The shape of parameter @p index.
 * @param[out] out_shape Room for #DPAR_MAX_DIMS extents. May be NULL.
 * @param[out] out_ndim  May be NULL.
 */
DPAR_API dpar_status dpar_model_param_info(int64_t *out_shape, size_t *out_ndim, const dpar_model *model,
                                           size_t index);
/**
 * @brief The name of parameter @p index ("<node name>.weight": "0.weight" by default, as PyTorch's state_dict
 * names it).
 * @return Borrowed from the model; valid until the model changes or is freed. NULL for a bad model or index, with
 *         dpar_last_error() saying why.
 */
DPAR_API const char *dpar_model_param_name(const dpar_model *model, size_t index);
/**
 * @brief Whether parameter @p index decays when dpar_engine_set_weight_decay_exclusion() is on: 0 for biases (of
 * Linear and Conv2d) and normalisation layers' weights and biases (BatchNorm, SyncBatchNorm, LayerNorm), 1 for all
 * others (Embedding's weight and custom layers' parameters included).
 * @param[out] out 1 or 0.
 */
DPAR_API dpar_status dpar_model_param_decays(int32_t *out, const dpar_model *model, size_t index);
/** @brief Copies parameter @p index into @p dst (@p count elements, exactly its size). */
DPAR_API dpar_status dpar_model_get_param(float *dst, const dpar_model *model, size_t index, size_t count);
/** @brief Overwrites parameter @p index from @p src (@p count elements, exactly its size). */
DPAR_API dpar_status dpar_model_set_param(dpar_model *model, size_t index, const float *src, size_t count);

/**
 * @brief The number of buffers: state of a layer that is not a parameter (BatchNorm's running_mean, running_var,
 * num_batches_tracked), never trained, reduced or counted among the parameters; saved in checkpoints.
 */
DPAR_API dpar_status dpar_model_num_buffers(size_t *out, const dpar_model *model);
/**
 * @brief The name of buffer @p index ("1.running_mean", as PyTorch's state_dict names it).
 * @return Borrowed from the model; valid until the model changes or is freed. NULL for a bad model or index, with
 *         dpar_last_error() saying why.
 */
DPAR_API const char *dpar_model_buffer_name(const dpar_model *model, size_t index);
/**
 * @brief The element type and shape of buffer @p index.
 * @param[out] out_dtype ::DPAR_F32 or ::DPAR_I64 (num_batches_tracked). May be NULL.
 * @param[out] out_shape Room for #DPAR_MAX_DIMS extents. May be NULL.
 * @param[out] out_ndim  0 for a scalar (one element), as PyTorch's num_batches_tracked. May be NULL.
 */
DPAR_API dpar_status dpar_model_buffer_info(int32_t *out_dtype, int64_t *out_shape, size_t *out_ndim,
                                            const dpar_model *model, size_t index);
/** @brief Copies buffer @p index into @p dst: @p count elements (exactly its size) of its dtype (float or int64_t). */
DPAR_API dpar_status dpar_model_get_buffer(void *dst, const dpar_model *model, size_t index, size_t count);
/** @brief Overwrites buffer @p index from @p src: @p count elements (exactly its size) of its dtype. */
DPAR_API dpar_status dpar_model_set_buffer(dpar_model *model, size_t index, const void *src, size_t count);
/**@}*/

#ifdef __cplusplus
}
#endif

#endif /* DPAR_MODEL_H */
