// libFuzzer harness: Engine::load (what dpar_engine_load runs) on arbitrary files, into an engine of two replicas
// with SGD and momentum. A refusal is CORRUPT or MISMATCH (IO cannot happen: the file is a regular file); after
// any outcome the engine must still train.
#include "engine/engine.h"
#include "fuzz_util.h"
#include "nn/layer.h"
#include "nn/model.h"

namespace {

using namespace dpar;

Engine& engine() {
  static Engine* e = [] {
    Model m(1);
    m.add(make_linear(3, 4, true));
    m.add(make_activation(Activation::kRelu));
    m.add(make_linear(4, 2, true));
    OptimizerConfig opt;
    opt.kind = OptimizerKind::kSgd;
    opt.lr = 0.1f;
    opt.momentum = 0.9f;
    EngineConfig c;
    c.devices = {Device{DeviceKind::kCpu, 0}, Device{DeviceKind::kCpu, 1}};
    c.timeout_seconds = 30;
    c.pin_workers = false;
    return new Engine(m, opt, std::move(c));  // lives as long as the process: libFuzzer never returns
  }();
  return *e;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = fuzz::scratch_path("checkpoint");
  fuzz::write_input(path, data, size);
  Engine& e = engine();
  fuzz::expect_only_documented_errors([&] { e.load(path); }, {Status::kCorrupt, Status::kMismatch});
  // Whatever the file was, the engine trains on (a refused file changed nothing; an accepted one is valid).
  static Tensor x = [] {
    Tensor t = Tensor::zeros(DType::kF32, Shape{4, 3}, Device{});
    for (int i = 0; i < 12; ++i) t.f32()[i] = 0.1f * static_cast<float>(i % 5);
    return t;
  }();
  static Tensor y = Tensor::zeros(DType::kI32, Shape{4}, Device{});
  e.train_step(x, y);
  return 0;
}
