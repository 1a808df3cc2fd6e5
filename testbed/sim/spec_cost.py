"""The drafting cost of speculative decoding, on top of any cost model's verify pass (built from the
config by `testbed.sim.cost_models.with_spec_decode`).

The target cost models price the verify pass themselves (its draft tokens are `BatchShape.num_spec_tokens`).
What drafting adds to a step depends on the method:
- draft: a small model proposes k tokens for each decode sequence, one forward pass per token, after the
  target's pass in the same step (vLLM's DraftModelProposer, vllm/v1/spec_decode/draft_model.py). Each
  pass is priced as a decode step of the draft model over the sequences that verify drafts, at their
  mean context, by the same cost model kind built for the draft's ModelSpec on the same hardware and
  parallelism, without the per-step and per-sequence host overheads (scheduling, input preparation,
  sampling are the target step's, paid once). Not priced: the first draft pass's extra query tokens
  (the tokens accepted in the step) and the drafts of requests whose prefill ends in the step.
- ngram: prompt lookup on the host (vLLM's NgramProposer): no model, `ngram_host_s` per step.
"""
from __future__ import annotations

from testbed.core.cost import BatchShape, CostModel, decode_run_ends


class SpecDecodeCostModel:
    """step_time = the target's step (with its verify pass) + the drafting of the step's decodes."""

    def __init__(self, target: CostModel, num_speculative_tokens: int, draft: CostModel | None = None,
                 host_s: float = 0.0):
        self.target, self.k, self.draft, self.host_s = target, num_speculative_tokens, draft, host_s
        self.name = target.name

    def __getattr__(self, key):  # a profile's header, a kernel model's tables: the target's
        return getattr(self.target, key)

    def step_time(self, s: BatchShape) -> float:
        t = self.target.step_time(s)
        if not s.num_spec_seqs:
            return t
        if self.draft is None:
            return t + self.host_s
        return t + self.k * self.draft.step_time(draft_pass(s))

    def decode_run_ends(self, s: BatchShape, start: float, k_max: int, next_arrival: float,
                        horizon: float) -> list[float]:
        # defined here so that `__getattr__` never hands out the target's, which knows no drafting
        return decode_run_ends(self.step_time, s, start, k_max, next_arrival, horizon)


def draft_pass(s: BatchShape) -> BatchShape:
    """One draft-model pass: a decode over the sequences that verify drafts, at the step's mean context."""
    mean_ctx = s.decode_kv_tokens / s.num_decode_seqs
    return BatchShape(num_decode_seqs=s.num_spec_seqs, decode_kv_tokens=round(mean_ctx * s.num_spec_seqs))
