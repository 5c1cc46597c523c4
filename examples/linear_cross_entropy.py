"""The Trellis LLM head from Python: load the operator library, compute the fused linear cross-entropy and its
gradients, and compare them with PyTorch's materialised-logits version.

    python examples/linear_cross_entropy.py --library build/bindings/libtrellis_ops.so [--device cuda]
"""
import argparse

import torch
import torch.nn.functional as F

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--library", required=True, help="path to libtrellis_ops.so")
parser.add_argument("--device", default="cpu")
args = parser.parse_args()
if args.device == "cuda" and not torch.cuda.is_available():
    raise SystemExit(77)  # skipped (CTest's SKIP_RETURN_CODE) where there is no GPU
torch.ops.load_library(args.library)

torch.manual_seed(0)
N, D, V = 64, 48, 1009
x = torch.randn(N, D, device=args.device, requires_grad=True)
weight = (torch.randn(V, D, device=args.device) / D**0.5).requires_grad_()
targets = torch.randint(0, V, (N,), device=args.device)
targets[::7] = -100  # ignored positions, e.g. padding

# Trellis: the N x V logits are never allocated whole.
loss = torch.ops.trellis.linear_cross_entropy(x, weight, targets, label_smoothing=0.1, z_loss=1e-4)
loss.backward()
logprobs, entropy = torch.ops.trellis.token_logprobs(x.detach(), weight.detach(), targets, entropy=True)

# The same with materialised logits.
x_ref, w_ref = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
logits = x_ref @ w_ref.T
lse = torch.logsumexp(logits, 1)
valid = targets != -100
ref = F.cross_entropy(logits, targets, label_smoothing=0.1) + 1e-4 * (lse[valid] ** 2).mean()
ref.backward()
ref_logprobs = torch.where(valid, logits.log_softmax(1).gather(1, targets.clamp(min=0)[:, None])[:, 0], 0)

# Training without a slab of logits: memory O(N) beyond the gradients, the logits formed twice.
x_rc, w_rc = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
torch.ops.trellis.linear_cross_entropy(x_rc, w_rc, targets, label_smoothing=0.1, z_loss=1e-4,
                                       recompute_logits=True).backward()

errors = {
    "loss": (loss - ref).abs().item(),
    "dx": (x.grad - x_ref.grad).abs().max().item(),
    "dW": (weight.grad - w_ref.grad).abs().max().item(),
    "dx, recomputed": (x_rc.grad - x_ref.grad).abs().max().item(),
    "dW, recomputed": (w_rc.grad - w_ref.grad).abs().max().item(),
    "token log-probs": (logprobs - ref_logprobs.detach()).abs().max().item(),
    "entropy": (entropy - torch.distributions.Categorical(logits=logits.detach()).entropy()).abs().max().item(),
}
print(f"loss {loss.item():.6f} (PyTorch {ref.item():.6f})")
for name, err in errors.items():
    print(f"max |difference| {name:16s} {err:.2e}")
if max(errors.values()) > 1e-4:
    raise SystemExit("Trellis and PyTorch disagree")
