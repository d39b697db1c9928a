// Dynamic loss scaling, as torch.amp.GradScaler: the loss's gradient is multiplied by `scale` so that small
// gradients survive a narrow floating-point format (f16's smallest normal is 6e-5), and the step is skipped when the
// scaled gradient overflowed. This is the state machine alone (GradScaler's _amp_update_scale_); the engine applies
// the scale, checks the summed gradient and tells it the outcome of each step.
#pragma once

#include <cstdint>

namespace dpar {

struct LossScaling {
  float init_scale = 0.0f;  // 0: off
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int64_t growth_interval = 2000;
  // Throws Status::kInvalidArgument naming the first bad value (`where` prefixes the message): init_scale finite
  // and >= 0, growth_factor finite and > 1, backoff_factor in (0, 1), growth_interval >= 1.
  void check(const char* where) const;
};

class LossScaler {
 public:
  // Checks `settings` (LossScaling::check) and starts over from them: scale init_scale, growth tracker 0, no step
  // skipped. Changes nothing when refused.
  void configure(const LossScaling& settings);
  // Puts back a saved state (a checkpoint's): the settings, the scale (finite and >= 0) and the growth tracker (0 to
  // growth_interval - 1); refused as `where`'s damage (Status::kCorrupt) otherwise, changing nothing.
  void restore(const LossScaling& settings, float scale, int64_t growth_tracker, const char* where);

  bool enabled() const { return settings_.init_scale > 0.0f; }
  const LossScaling& settings() const { return settings_; }
  // The factor of the loss's gradient: the current scale, 1 when off (GradScaler.get_scale() of a disabled scaler).
  float scale() const { return enabled() ? scale_ : 1.0f; }
  // Clean steps since the last change of the scale.
  int64_t growth_tracker() const { return tracker_; }
  // Whether the last step taken with scaling on was skipped (its gradient held inf or NaN); false before any.
  bool last_step_skipped() const { return last_skipped_; }

  // The outcome of a step taken with scaling on, in GradScaler.update()'s float arithmetic: an overflow multiplies
  // the scale by backoff_factor and restarts the tracker; growth_interval clean steps in a row multiply it by
  // growth_factor (kept only where the product is finite) and restart the tracker.
  void update(bool found_inf);

 private:
  LossScaling settings_;
  float scale_ = 1.0f;
  int64_t tracker_ = 0;
  bool last_skipped_ = false;
};

}  // namespace dpar
