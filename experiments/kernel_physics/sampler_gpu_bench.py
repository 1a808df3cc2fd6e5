"""Time vLLM 0.15.1's sampler op sequence on a GPU, per case, for the sort-path fit (issue 23).

Why: SAMPLER.md's constants come from other people's microbenchmarks (mostly not at V=152064,
GPU often unstated). This script replays, with plain torch ops, what vLLM 0.15.1 runs per decode
step after the LM head (vllm/v1/sample/sampler.py:90-141, ops/topk_topp_sampler.py:92-111,
243-332, ops/penalties.py:11-57, model_executor/layers/utils.py:41-96) so one device session
can measure greedy / temperature / top-p / top-k+top-p / +penalties against B and V on the
calibration GPU. The repetition penalty uses the torch form (vLLM's CUDA kernel
`apply_repetition_penalties_` is not available without vLLM; same bytes).

Run (device): python experiments/kernel_physics/sampler_gpu_bench.py --out $OUT/sampler_h100.csv
Smoke test (CPU): python experiments/kernel_physics/sampler_gpu_bench.py --device cpu --batches 2 --vocabs 1000 --iters 2
"""

import argparse
import csv
import time

import torch


def sample(logits16, temp, k, p, penalties, out_tokens, prompt_tokens, greedy):
    """One decode step's sampler work on [B, V] bf16 logits, in vLLM 0.15.1's order."""
    logits = logits16.to(torch.float32)
    b, v = logits.shape
    if penalties:
        def bins(tokens):
            counts = torch.zeros((b, v + 1), dtype=torch.long, device=logits.device)
            counts.scatter_add_(1, tokens, torch.ones_like(tokens))
            counts = counts[:, :v]
            return counts, counts > 0
        _, prompt_mask = bins(prompt_tokens)
        out_counts, out_mask = bins(out_tokens)
        rep = penalties * torch.ones(b, 1, device=logits.device)
        pen = torch.where(prompt_mask | out_mask, rep, 1.0)
        logits *= torch.where(logits > 0, 1.0 / pen, pen)
        zero = torch.zeros(b, device=logits.device)
        logits -= zero.unsqueeze(1) * out_counts
        logits -= zero.unsqueeze(1) * out_mask
    if greedy:
        return logits.argmax(dim=-1)
    logits.div_(temp.unsqueeze(1))
    if p is not None:
        srt, idx = logits.sort(dim=-1, descending=False)
        if k is not None:
            kth = srt.gather(1, (srt.size(1) - k.to(torch.long)).unsqueeze(1))
            srt.masked_fill_(srt < kth, -float("inf"))
        probs = srt.softmax(dim=-1)
        csum = torch.cumsum(probs, dim=-1, out=probs)
        mask = csum <= 1 - p.unsqueeze(1)
        mask[:, -1] = False
        srt.masked_fill_(mask, -float("inf"))
        logits = srt.scatter(dim=-1, index=idx, src=srt)
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    q = torch.empty_like(probs)
    q.exponential_()
    return probs.div_(q).argmax(dim=-1)


CASES = {  # name: (greedy, top_k, top_p, repetition_penalty)
    "greedy": (True, None, None, 0.0),
    "temperature": (False, None, None, 0.0),
    "topp": (False, None, 0.9, 0.0),
    "topk_topp": (False, 20, 0.8, 0.0),
    "topk_topp_rep": (False, 20, 0.8, 1.05),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64, 96, 127, 128, 192, 256, 384, 512])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[128256, 152064])
    ap.add_argument("--hist", type=int, default=1024, help="prompt and output tokens per row (penalties)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="sampler_bench.csv")
    a = ap.parse_args()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    rows = []
    for v in a.vocabs:
        for b in a.batches:
            logits16 = torch.randn(b, v, device=dev).to(torch.bfloat16)
            temp = torch.full((b,), 0.7, device=dev)
            toks = torch.randint(0, v, (b, a.hist), device=dev)
            for name, (greedy, k, p, rep) in CASES.items():
                kk = None if k is None else torch.full((b,), k, dtype=torch.int32, device=dev)
                pp = None if p is None else torch.full((b,), p, device=dev)
                run = lambda: sample(logits16, temp, kk, pp, rep, toks, toks, greedy)  # noqa: E731
                for _ in range(3):
                    run()
                times = []
                for _ in range(a.iters):
                    if cuda:
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record(); run(); e.record(); torch.cuda.synchronize()
                        times.append(s.elapsed_time(e))
                    else:
                        t0 = time.perf_counter(); run(); times.append((time.perf_counter() - t0) * 1e3)
                times.sort()
                rows.append({"case": name, "batch": b, "vocab": v, "median_ms": times[len(times) // 2],
                             "min_ms": times[0], "device": torch.cuda.get_device_name() if cuda else "cpu",
                             "torch": torch.__version__})
                print(rows[-1], flush=True)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader(); w.writerows(rows)


if __name__ == "__main__":
    main()
