// Where a task runs. Options structs (CrfTrainOptions, NeuralTaggerOptions, HMMRunOptions) hold a c10::Device, the
// type LibTorch places tensors with; parse_device turns the command line's text into one.
#pragma once
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <string>

#include "trellis/error.h"

namespace trellis {

// "cpu", "cuda" or "cuda:N" as a device; anything else (another LibTorch device type included) is an Error naming
// `option`. Whether a CUDA device exists is checked where the device is used, not here.
inline c10::Device parse_device(const std::string& text, const std::string& option = "--device") {
  const std::string wrong = option + " must be cpu, cuda or cuda:N, not '" + text + "'";
  try {
    const c10::Device device(text);
    if (!device.is_cpu() && !device.is_cuda()) throw Error(wrong);
    if (device.is_cpu() && device.has_index()) throw Error(wrong);
    return device;
  } catch (const c10::Error&) {
    throw Error(wrong);
  }
}

}  // namespace trellis
