// Where a task runs. Options structs (CrfTrainOptions, NeuralTaggerOptions, HMMRunOptions) hold a c10::Device, the
// type LibTorch places tensors with; parse_device turns the command line's text into one.
#pragma once
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <string>

#include "trellis/error.h"

namespace trellis {

// "cpu", "cuda" or "cuda:N" as a device; anything else (another LibTorch device type included) is an Error naming
// `option`. Whether a CUDA device exists is check_device_available's question, not this one's.
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

// Throws an Error naming `option` and the device where `device` is a CUDA device that this machine does not have (no
// driver or no GPU, with the CUDA runtime's reason; or an index beyond the GPUs there are), before any work is done:
// LibTorch's own message comes at the first tensor moved and reads as an internal error. Nothing for the CPU.
void check_device_available(c10::Device device, const std::string& option = "--device");

}  // namespace trellis
