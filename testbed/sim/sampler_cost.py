"""The GPU time of vLLM's sampler in one step: the term the measured kernel tables lack.

Why: after the LM head, every vLLM step samples one token per scheduled sequence on the GPU, eagerly
(outside the CUDA graph), over fp32 logits of shape [sequences, vocabulary] (vllm/v1/worker/
gpu_model_runner.py `_sample`; vllm/v1/sample/sampler.py). aiconfigurator's tables hold no sampler
op, so the composed step missed it, and what it costs depends on the vocabulary and on the sampling
parameters (testbed.core.sampling): Llama-3.x's default top_p 0.9 sorts 128k logits per sequence per
step (`apply_top_k_top_p`, ops/topk_topp_sampler.py L243-283), Qwen2.5-Instruct's defaults add a
top-k mask and the penalties pass, while a model with no generation defaults only draws at
temperature 1. That is why the calibration set (32k vocabularies, three of four models without
top-p) could not show it, and why the decode steps of 128k-152k-vocabulary models came out short by a
share that grows with the batch.

The form, per path (vLLM 0.15.1 on CUDA: `forward_native`, FlashInfer's sampler is opt-in):
    time = kernels x kernel_s + bytes_per_logit x sequences x vocabulary / hardware.mem_bandwidth
with `kernels` the eager kernels the path launches (each at least `kernel_s` on the GPU) and
`bytes_per_logit` the bytes its passes stream per logit, counted from vLLM 0.15.1's code (experiments/
kernel_physics/SAMPLER.md, section 3), except the sort, whose rate is measured:
- the whole-vocabulary sort path (`apply_top_k_top_p`: torch.sort with int64 indices, top-k mask,
  softmax, cumsum, masks, scatter back): 0.122 ns per logit on an H100 for batch x vocabulary of a few
  million and more (published CUDA-event timings of that very function, vLLM PRs #33538, #32558 and the
  H100 table of #42191; fit in experiments/kernel_physics/fit_sampler.py), i.e. 364 bytes per logit at
  the H100's 2.98 TB/s achievable bandwidth (`hardware.mem_bandwidth`), so other GPUs scale it by
  their bandwidth; its fixed part, 15 kernels;
- `kernel_s` = 6.5 us: the sort path on an H100 at one sequence takes 0.09-0.13 ms (#42191) for its ~15
  kernels, i.e. the GPU-side floor of one small eager kernel;
- every random path: the fp32 cast, temperature division, softmax, exponential noise, division and
  argmax (6 kernels, ~50 bytes per logit); greedy: cast and argmax (2 kernels, ~10 bytes);
- top-k without top-p (`apply_top_k_only`: torch.topk, gather, two masks): 5 kernels, ~30 bytes;
- min-p: softmax, max, compare, mask: 4 kernels, ~20 bytes;
- the penalties pass (two int64 token-count buffers over the vocabulary with scatter-add, the
  repetition-penalty kernel, the frequency and presence updates, ops/penalties.py and
  model_executor/layers/utils.py L41-96): 12 kernels, ~85 bytes.
No GPU was lent to measure the whole sampler; the figures not measured are byte and kernel counts, and
the README's validation table scores the result. Under async scheduling the sampler's host-side launches
overlap the forward pass, so only its GPU time is charged here.
"""
from __future__ import annotations

from dataclasses import dataclass

from testbed.core.sampling import SamplingParams

KERNEL_S = 6.5e-6  # one eager sampler kernel's GPU floor (H100; vLLM #42191, sort path at batch 1)
SORT_BYTES_PER_LOGIT = 364.0  # measured: 0.122 ns/logit on an H100 x its 2.98 TB/s achievable bandwidth

# (kernels, streamed bytes per logit) of each pass, from vLLM 0.15.1's code
GREEDY = (2, 10.0)
RANDOM = (6, 50.0)
SORT = (15, SORT_BYTES_PER_LOGIT)
TOP_K_ONLY = (5, 30.0)
MIN_P = (4, 20.0)
PENALTIES = (12, 85.0)


@dataclass(frozen=True)
class SamplerCost:
    """One step's sampler time for `rows` sampled sequences under one set of sampling parameters."""

    params: SamplingParams
    vocab_size: int
    mem_bandwidth: float  # bytes/s the GPU achieves (hardware.mem_bandwidth)
    kernel_s: float = KERNEL_S
    sort_bytes_per_logit: float = SORT_BYTES_PER_LOGIT

    def __post_init__(self) -> None:
        if not self.vocab_size >= 1 or not self.mem_bandwidth > 0:
            raise ValueError(f"sampler cost: vocab_size={self.vocab_size}, mem_bandwidth={self.mem_bandwidth}: "
                             f"both must be positive")
        if not self.kernel_s >= 0 or not self.sort_bytes_per_logit >= 0:
            raise ValueError(f"cost_model.sampler_kernel_s={self.kernel_s}, cost_model.sampler_sort_bytes_per_logit="
                             f"{self.sort_bytes_per_logit}: must be >= 0")

    @property
    def passes(self) -> list[tuple[int, float]]:
        """(kernels, bytes per logit) of each pass this path runs."""
        p, v = self.params, self.vocab_size
        if p.greedy:
            return [GREEDY] + ([PENALTIES] if p.penalties else [])
        out = [RANDOM]
        if p.sorts_vocabulary():
            out.append((SORT[0], self.sort_bytes_per_logit))
        elif p.top_k_only(v):
            out.append(TOP_K_ONLY)
        if p.min_p > 0:
            out.append(MIN_P)
        if p.penalties:
            out.append(PENALTIES)
        return out

    @property
    def fixed_s(self) -> float:
        return sum(k for k, _ in self.passes) * self.kernel_s

    @property
    def per_row_s(self) -> float:
        return sum(b for _, b in self.passes) * self.vocab_size / self.mem_bandwidth

    def time(self, rows: int) -> float:
        """Seconds for a step sampling `rows` sequences (0 rows: no sampler runs)."""
        return self.fixed_s + self.per_row_s * rows if rows > 0 else 0.0
