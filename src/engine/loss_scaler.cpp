#include "engine/loss_scaler.h"

#include <cmath>

#include "common/error.h"

namespace dpar {

void LossScaling::check(const char* where) const {
  DPAR_CHECK_ARG(std::isfinite(init_scale) && init_scale >= 0.0f, where, ": init_scale ", init_scale,
                 " must be finite and >= 0 (0 turns loss scaling off)");
  DPAR_CHECK_ARG(std::isfinite(growth_factor) && growth_factor > 1.0f, where, ": growth_factor ", growth_factor,
                 " must be finite and > 1");
  DPAR_CHECK_ARG(backoff_factor > 0.0f && backoff_factor < 1.0f, where, ": backoff_factor ", backoff_factor,
                 " must be in (0, 1)");
  DPAR_CHECK_ARG(growth_interval >= 1, where, ": growth_interval ", growth_interval, " must be >= 1");
}

void LossScaler::configure(const LossScaling& settings) {
  settings.check("loss scaling");
  settings_ = settings;
  scale_ = settings.init_scale > 0.0f ? settings.init_scale : 1.0f;
  tracker_ = 0;
  last_skipped_ = false;
}

void LossScaler::restore(const LossScaling& settings, float scale, int64_t growth_tracker, const char* where) {
  try {
    settings.check(where);
  } catch (const Error& e) {
    fail(Status::kCorrupt, e.what());
  }
  DPAR_ENFORCE(settings.init_scale > 0.0f, Status::kCorrupt, where, ": init_scale 0 (loss scaling off) with a state");
  DPAR_ENFORCE(std::isfinite(scale) && scale >= 0.0f, Status::kCorrupt, where, ": scale ", scale,
               " must be finite and >= 0");
  DPAR_ENFORCE(growth_tracker >= 0 && growth_tracker < settings.growth_interval, Status::kCorrupt, where,
               ": growth tracker ", growth_tracker, " is not in [0, ", settings.growth_interval, ")");
  settings_ = settings;
  scale_ = scale;
  tracker_ = growth_tracker;
  last_skipped_ = false;
}

void LossScaler::update(bool found_inf) {
  last_skipped_ = found_inf;
  if (found_inf) {
    scale_ *= settings_.backoff_factor;
    tracker_ = 0;
    return;
  }
  if (++tracker_ < settings_.growth_interval) return;
  const float grown = scale_ * settings_.growth_factor;
  if (std::isfinite(grown)) scale_ = grown;
  tracker_ = 0;
}

}  // namespace dpar
