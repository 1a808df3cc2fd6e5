"""Output-length predictors for the length-aware policies (sjf, srpt, ltr).

Not a policy (the leading underscore keeps `policies/__init__` from importing it as one):
a predictor maps a trace request to a predicted output length in tokens, from what a
real predictor could be built to approximate. All three read the trace's true
`req.output_len`, degraded in a controlled way, so an experiment can say how much of a
policy's gain survives a given prediction error:

- `oracle`: the true output length. No real system has it: it is an UPPER BOUND on what
  any predictor can buy, and results with it must be labelled as such (`label`).
- `noisy_oracle`: the true length times lognormal noise, exp(N(0, sigma)), so
  log(prediction / truth) has standard deviation `sigma`. The noise of each request is
  seeded from (seed, request id) alone, so a request gets the same prediction whatever
  the order in which requests are asked about, on every replica and every rerun.
- `bucket`: the length class a classifier over `buckets` boundaries would predict, taken
  as the class's upper boundary (the true length rounded up to the next boundary; a
  length above the last boundary falls in an open top class, predicted as twice the last
  boundary so that it ranks after every bounded class). Perfectly accurate classes: an
  upper bound for classifier-based schedulers, like the oracle for regressors.

Predictions are positive numbers of tokens (floats for `noisy_oracle`); policies rank by
them, so only their order, and for SRPT their difference with the tokens generated,
matters. `make_predictor(kind, sigma, buckets, seed)` builds one from policy knobs.
"""
from __future__ import annotations

import bisect
import math
import random

from dataclasses import dataclass

from testbed.core.bounds import bounded
from testbed.core.policy import PolicyKnobs
from testbed.core.request import Request

PREDICTORS = ("oracle", "noisy_oracle", "bucket")
DEFAULT_BUCKETS = (16, 64, 256, 1024, 4096)


class OraclePredictor:
    """The true output length: an upper bound on prediction quality, not a real predictor."""

    kind = "oracle"
    label = "oracle (upper bound)"

    def predict(self, req: Request) -> float:
        return req.output_len


class NoisyOraclePredictor:
    """True length times exp(N(0, sigma)), the noise seeded from (seed, request id) only."""

    kind = "noisy_oracle"

    def __init__(self, sigma: float, seed: int = 0):
        if not sigma >= 0:
            raise ValueError(f"policy.sigma={sigma}: the noisy oracle's log-noise std must be >= 0")
        self.sigma, self.seed = float(sigma), int(seed)
        self.label = f"noisy oracle (sigma={self.sigma:g}, oracle-derived)"

    def predict(self, req: Request) -> float:
        if self.sigma == 0:
            return float(req.output_len)
        # A string seed is hashed with SHA-512 by `random`: deterministic across runs and
        # processes (unlike hash()), and independent of every other request's draw.
        z = random.Random(f"noisy_oracle:{self.seed}:{req.id}").gauss(0.0, self.sigma)
        return req.output_len * math.exp(z)


class BucketPredictor:
    """The class upper boundary of the true length: what a perfect length classifier says."""

    kind = "bucket"

    def __init__(self, buckets):
        b = [int(x) for x in buckets]
        if not b:
            raise ValueError("policy.buckets is empty: the bucket predictor needs at least one boundary")
        if any(x < 1 for x in b) or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"policy.buckets={list(buckets)}: boundaries must be positive and strictly increasing")
        self.buckets = b
        self.top = 2 * b[-1]  # the open class above the last boundary
        self.label = f"bucket classifier {b} (oracle-derived)"

    def predict(self, req: Request) -> float:
        i = bisect.bisect_left(self.buckets, req.output_len)
        return self.buckets[i] if i < len(self.buckets) else self.top


def make_predictor(kind: str, sigma: float = 0.5, buckets=DEFAULT_BUCKETS, seed: int = 0):
    """Build the predictor a policy's knobs name."""
    if kind == "oracle":
        return OraclePredictor()
    if kind == "noisy_oracle":
        return NoisyOraclePredictor(sigma, seed)
    if kind == "bucket":
        return BucketPredictor(buckets)
    raise ValueError(f"policy.predictor={kind!r}: expected one of {PREDICTORS}")


@dataclass
class PredictorKnobs(PolicyKnobs):
    """The knobs every length-predicting policy shares (sjf, srpt, ltr)."""

    predictor: str = "oracle"  # oracle (upper bound) | noisy_oracle | bucket
    sigma: float = bounded(0.5, ge=0)  # noisy_oracle: std of log(prediction / true length)
    buckets: list[int] = bounded(factory=lambda: list(DEFAULT_BUCKETS), ge=1)  # bucket: class boundaries
    seed: int = bounded(0, ge=0)  # noisy_oracle: noise seed (with the request id)

    def __post_init__(self):
        super().__post_init__()
        make_predictor(self.predictor, self.sigma, self.buckets, self.seed)  # fail early on a bad predictor

    def make(self):
        return make_predictor(self.predictor, self.sigma, self.buckets, self.seed)
