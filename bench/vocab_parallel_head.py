"""Vocabulary-parallel LLM head, one process per GPU (torchrun): Trellis' vocab_parallel_linear_cross_entropy (and
vocab_parallel_token_logprobs, the log-probabilities with their gradients) beside
Megatron-style vocab-parallel cross-entropy in plain PyTorch (local float32 logits, three all-reduces) and Liger's
LigerVocabParallelCEFunction (on materialised local logits, when liger_kernel imports), each with the local
half-vocabulary GEMM x·W_rᵀ as the unit. W's rows are split in rank order; x and the targets are the same everywhere.

    torchrun --nproc-per-node=P bench/vocab_parallel_head.py --library build/bindings/libtrellis_ops.so --json out.json

Method (docs/benchmarks.md): CUDA events around each call, a 256 MB buffer zeroed before every call to flush L2, one
untimed warm-up, the median of up to 25 timed calls within about 400 ms (at least 3); memory is the peak allocated
during one call beyond what was allocated before it (gradients included). Agreement: the loss and dx, and the
log-probabilities, entropies and their dx, against the single-device Trellis head on the whole W, on every rank.
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--library", required=True)
parser.add_argument("--json", help="rank 0 writes the rows here (appending to a list already there)")
parser.add_argument("--rows", type=int, default=16384)
parser.add_argument("--hidden", type=int, default=4096)
parser.add_argument("--vocabulary", type=int, default=128256)
parser.add_argument("--commit", default=os.environ.get("TRELLIS_COMMIT", "unknown"))
parser.add_argument("--cpu", action="store_true",
                    help="a check of the script itself: Gloo, float32, CPU, no timings; fails where a result disagrees")
args = parser.parse_args()

if args.cpu:
    # A check of the script on a machine without GPUs: the same calls, no timing.
    torch.cuda.Event = None
if args.cpu:
    dist.init_process_group("gloo")
else:  # each rank's GPU made current and named to NCCL before any collective (no guess from the global rank)
    local_device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(local_device)
    dist.init_process_group("nccl", device_id=local_device)
rank, world = dist.get_rank(), dist.get_world_size()
device, dtype = ("cpu", torch.float32) if args.cpu else ("cuda", torch.bfloat16)
torch.ops.load_library(args.library)
ops = torch.ops.trellis
group = dist.group.WORLD
N, D, V = args.rows, args.hidden, args.vocabulary
sizes = [V // world + (1 if r < V % world else 0) for r in range(world)]
begin = sum(sizes[:rank])
torch.manual_seed(0)
x0 = torch.randn(N, D, device=device).to(dtype)
w_full = (torch.randn(V, D, device=device) * (2 / D**0.5)).to(dtype)
targets = torch.randint(0, V, (N,), device=device)
w0 = w_full[begin:begin + sizes[rank]].contiguous()
flush = None if args.cpu else torch.empty(256 << 20, dtype=torch.uint8, device=device)


def timed(fn):
    """Median milliseconds and peak extra bytes of fn(), as in the method above."""
    fn()
    if args.cpu:
        return 1.0, 0
    torch.cuda.synchronize()
    times, peak, budget = [], 0, 0.0
    while len(times) < 25 and (len(times) < 3 or budget < 400):
        flush.zero_()
        torch.cuda.synchronize()
        dist.barrier()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        budget += times[-1]
        peak = max(peak, torch.cuda.max_memory_allocated() - before)
    return statistics.median(times), peak


class ReduceGradient(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward: x entering a vocabulary-parallel layer (Megatron's
    copy-to-tensor-parallel region)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=group)
        return g


class MegatronCrossEntropy(torch.autograd.Function):
    """Megatron-LM's vocab_parallel_cross_entropy on local float32 logits: max, target logit and exp-sum all-reduced."""

    @staticmethod
    def forward(ctx, logits, target):
        logits_max = logits.max(dim=-1)[0]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        logits = logits - logits_max.unsqueeze(-1)
        here = (target >= begin) & (target < begin + sizes[rank])
        local = torch.where(here, target - begin, 0)
        predicted = logits.gather(1, local.unsqueeze(1)).squeeze(1) * here
        dist.all_reduce(predicted, group=group)
        exp = logits.exp_()
        sum_exp = exp.sum(-1)
        dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - predicted
        exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp, local, here)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, local, here = ctx.saved_tensors
        softmax.scatter_add_(1, local.unsqueeze(1), -here.to(softmax.dtype).unsqueeze(1))
        return softmax.mul_(g.unsqueeze(1)), None


def megatron(x, w):
    logits = (ReduceGradient.apply(x) @ w.t()).float()
    return MegatronCrossEntropy.apply(logits, targets).mean()


try:
    from liger_kernel.ops.vocab_parallel_cross_entropy import LigerVocabParallelCEFunction
except ImportError:
    LigerVocabParallelCEFunction = None


def liger(x, w):
    logits = (ReduceGradient.apply(x) @ w.t()).view(N, 1, -1)
    return LigerVocabParallelCEFunction.apply(logits, targets.view(N, 1), group, -100, 0.0, "pytorch", "global").mean()


def trellis(x, w):
    return ops.vocab_parallel_linear_cross_entropy(x, w, targets, group.group_name)


def leaves(grad):
    return x0.detach().clone().requires_grad_(grad), w0.detach().clone().requires_grad_(grad)


gemm_ms, _ = timed(lambda: x0 @ w0.t())
rows = []


def row(name, fwd, fwd_bwd):
    fwd_ms, fwd_mem = fwd
    step_ms, step_mem = fwd_bwd
    rows.append({"world_size": world, "rank": rank, "implementation": name, "N": N, "D": D, "V": V,
                 "local_vocabulary": sizes[rank], "local_gemm_ms": gemm_ms, "fwd_ms": fwd_ms,
                 "fwd_ratio": fwd_ms / gemm_ms, "fwd_extra_bytes": fwd_mem, "fwd_bwd_ms": step_ms,
                 "fwd_bwd_ratio": step_ms / gemm_ms, "fwd_bwd_extra_bytes": step_mem,
                 "device": "cpu" if args.cpu else torch.cuda.get_device_name(), "commit": args.commit})


def measure(name, loss_fn):
    # Progress on stderr as each measurement starts: where a run stops is then in its log.
    print(f"rank {rank}: {name}", file=sys.stderr, flush=True)
    with torch.no_grad():
        x, w = leaves(False)
        fwd = timed(lambda: loss_fn(x, w))
    x, w = leaves(True)

    def step():
        x.grad = w.grad = None
        loss_fn(x, w).backward()

    row(name, fwd, timed(step))


measure("trellis", trellis)
if world == 1:  # the process-group path's overhead: the same call without a group
    measure("trellis single-device linear_cross_entropy", lambda x, w: ops.linear_cross_entropy(x, w, targets))
# The log-probabilities (RL's policy-gradient term): the vocabulary-parallel operator's backward beside the
# single-device one's at world size 1.
measure("trellis vocab_parallel_token_logprobs",
        lambda x, w: ops.vocab_parallel_token_logprobs(x, w, targets, group.group_name)[0].mean())
if world == 1:
    measure("trellis single-device token_logprobs", lambda x, w: ops.token_logprobs(x, w, targets)[0].mean())
measure("megatron-style (plain PyTorch)", megatron)
if LigerVocabParallelCEFunction is not None and not args.cpu:
    measure("liger LigerVocabParallelCEFunction", liger)

# Agreement with the single-device head on the whole vocabulary.
print(f"rank {rank}: agreement", file=sys.stderr, flush=True)
x, w = leaves(True)
loss = trellis(x, w)
loss.backward()
xr = x0.detach().clone().requires_grad_()
reference = ops.linear_cross_entropy(xr, w_full, targets)
reference.backward()


def relative(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


agreement = {"world_size": world, "loss": loss.item(), "reference_loss": reference.item(),
             "loss_relative_error": abs(loss.item() - reference.item()) / abs(reference.item()),
             "dx_relative_error": relative(x.grad, xr.grad)}
# The log-probabilities and entropies with their gradient for x (the policy-gradient and entropy-bonus terms).
x, w = leaves(True)
logprobs, entropy = ops.vocab_parallel_token_logprobs(x, w, targets, group.group_name, entropy=True)
(logprobs.sum() - 0.01 * entropy.sum()).backward()
xr = x0.detach().clone().requires_grad_()
reference_logprobs, reference_entropy = ops.token_logprobs(xr, w_full, targets, entropy=True)
(reference_logprobs.sum() - 0.01 * reference_entropy.sum()).backward()
agreement.update(logprobs_relative_error=relative(logprobs, reference_logprobs),
                 entropy_relative_error=relative(entropy, reference_entropy),
                 token_logprobs_dx_relative_error=relative(x.grad, xr.grad))
if args.cpu:  # float32 on the CPU: the single-device results within 1e-5 relative
    wrong = {k: v for k, v in agreement.items() if k.endswith("_error") and not v <= 1e-5}
    if wrong:
        raise SystemExit(f"rank {rank}: the vocabulary-parallel head disagrees with one device: {wrong}")

gathered = [None] * world
dist.all_gather_object(gathered, rows)
if rank == 0:
    everything = [r for part in gathered for r in part] + [agreement]
    for r in everything:
        print(json.dumps(r))
    if args.json:
        previous = json.load(open(args.json)) if os.path.exists(args.json) else []
        json.dump(previous + everything, open(args.json, "w"), indent=1)
# The group goes with destroy_process_group, not later at the interpreter's exit, when the other ranks are gone and
# Gloo's teardown aborts the process.
del group
dist.destroy_process_group()
