// An LLM output head in an application: a few steps of training a linear layer on next-token targets with the fused
// linear cross-entropy (the N×V logits are never allocated whole), then per-token log-probabilities and entropies.
// Usage: llm_head [cpu|cuda]
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <trellis/head/linear_cross_entropy.h>

#include <cstdio>
#include <exception>
#include <string>

int main(int argc, char** argv) {
  try {
    const at::Device device(argc > 1 ? std::string(argv[1]) : std::string("cpu"));
    at::manual_seed(0);
    const int64_t N = 512, D = 64, V = 5003;
    const auto opts = at::TensorOptions().device(device);
    const at::Tensor hidden = at::randn({N, D}, opts);
    // Targets that the hidden states predict (a fixed random projection), so that the loss can fall.
    const at::Tensor targets = at::mm(hidden, at::randn({D, V}, opts)).argmax(1);
    at::Tensor weight = (at::randn({V, D}, opts) * 0.01).requires_grad_();

    trellis::HeadOptions head;
    head.chunk_bytes = int64_t(4) << 20;  // 4 MiB of logits at a time instead of N×V×4 = 10 MiB
    trellis::LossOptions loss_options;
    loss_options.label_smoothing = 0.05;
    double first = 0, last = 0;
    for (int step = 0; step < 20; ++step) {
      const at::Tensor loss = trellis::linear_cross_entropy(hidden, weight, targets, head, loss_options);
      loss.backward();
      {
        c10::NoGradGuard no_grad;
        weight -= 2.0 * weight.grad();
        weight.mutable_grad().zero_();
      }
      (step == 0 ? first : last) = loss.item<double>();
    }
    std::printf("loss: %.4f after the first step, %.4f after 20\n", first, last);
    const trellis::TokenLogprobs r = trellis::token_logprobs(hidden, weight.detach(), targets, head, true);
    std::printf("mean target log-prob %.4f, mean entropy %.4f nats\n", r.logprobs.mean().item<double>(),
                r.entropy.mean().item<double>());
    return last < first ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llm_head: %s\n", e.what());
    return 1;
  }
}
