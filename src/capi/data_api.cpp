#include "capi/api.h"

using namespace dpar;
using namespace dpar::capi;

extern "C" {

DPAR_API dpar_status dpar_dataset_load_idx(dpar_dataset** out, const char* images_path, const char* labels_path) {
  return guard([&] {
    checked_out(out);
    *out = nullptr;
    DPAR_CHECK_ARG(images_path != nullptr, "images_path: is NULL");
    DPAR_CHECK_ARG(labels_path != nullptr, "labels_path: is NULL");
    auto ds = std::make_shared<io::Dataset>(io::Dataset::load_idx(images_path, labels_path));
    auto* h = new_handle<dpar_dataset>();
    h->dataset = std::move(ds);
    *out = h;
  });
}

DPAR_API void dpar_dataset_free(dpar_dataset* dataset) { free_handle(dataset); }

DPAR_API dpar_status dpar_dataset_info(size_t* out_samples, size_t* out_features, size_t* out_classes,
                                       const dpar_dataset* dataset) {
  return guard([&] {
    const auto& d = *checked(dataset, "dataset").dataset;
    if (out_samples) *out_samples = d.size();
    if (out_features) *out_features = d.features();
    if (out_classes) *out_classes = d.classes();
  });
}

DPAR_API dpar_status dpar_dataset_normalize(dpar_dataset* dataset, float mean, float std) {
  return guard([&] { checked(dataset, "dataset").dataset->normalize(mean, std); });
}

DPAR_API dpar_status dpar_loader_create(dpar_loader** out, const dpar_dataset* dataset, size_t batch_size,
                                        int32_t shuffle, uint64_t seed, int32_t drop_last) {
  return guard([&] {
    checked_out(out);
    *out = nullptr;
    const dpar_dataset& d = checked(dataset, "dataset");
    auto* h = new_handle<dpar_loader>(d.dataset, batch_size, shuffle != 0, seed, drop_last != 0);
    h->inputs.owned_by_parent = true;
    h->labels.owned_by_parent = true;
    *out = h;
  });
}

DPAR_API void dpar_loader_free(dpar_loader* loader) {
  if (!loader || !take_handle(loader, HandleKind::kLoader)) return;
  unregister_handle(&loader->inputs);
  unregister_handle(&loader->labels);
  delete loader;
}

DPAR_API dpar_status dpar_loader_start_epoch(dpar_loader* loader, uint64_t epoch) {
  return guard([&] { checked(loader, "loader").loader.start_epoch(epoch); });
}

DPAR_API dpar_status dpar_loader_num_batches(size_t* out, const dpar_loader* loader) {
  return guard([&] { *checked_out(out) = checked(loader, "loader").loader.num_batches(); });
}

DPAR_API dpar_status dpar_loader_shard(dpar_loader* loader, size_t shard, size_t num_shards) {
  return guard([&] { checked(loader, "loader").loader.set_shard(shard, num_shards); });
}

DPAR_API dpar_status dpar_loader_to_device(dpar_loader* loader, dpar_device device) {
  return guard([&] {
    dpar_loader& l = checked(loader, "loader");
    l.loader.set_device(checked_device(device, "device"));
  });
}

DPAR_API dpar_status dpar_loader_next(int32_t* out, dpar_loader* loader) {
  return guard([&] {
    checked_out(out);
    *out = 0;
    dpar_loader& l = checked(loader, "loader");
    l.has_batch = false;
    if (!l.loader.next(l.inputs.tensor, l.labels.tensor)) return;
    register_handle(&l.inputs, HandleKind::kTensor);
    register_handle(&l.labels, HandleKind::kTensor);
    l.has_batch = true;
    *out = 1;
  });
}

DPAR_API const dpar_tensor* dpar_loader_inputs(const dpar_loader* loader) {
  const dpar_tensor* t = nullptr;
  guard([&] {
    const dpar_loader& l = checked(loader, "loader");
    if (l.has_batch) t = &l.inputs;
  });
  return t;
}

DPAR_API const dpar_tensor* dpar_loader_labels(const dpar_loader* loader) {
  const dpar_tensor* t = nullptr;
  guard([&] {
    const dpar_loader& l = checked(loader, "loader");
    if (l.has_batch) t = &l.labels;
  });
  return t;
}

}  // extern "C"
