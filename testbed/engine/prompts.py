"""Token ids for trace requests, which carry lengths but no text.

Timing depends on shapes, not on which tokens run, but prefix sharing must be real: two
requests whose trace prefix hashes agree get identical leading tokens, so the KV blocks
the engine shares hold identical content. Each 512-token trace block's tokens are drawn
from a generator seeded by its hash id; the rest of a prompt from one seeded by the
request id. Deterministic for a seed.
"""
from __future__ import annotations

import numpy as np

from testbed.core.request import Request


class PromptTokens:
    def __init__(self, vocab_size: int, seed: int = 0, low: int = 16):
        if vocab_size <= low:
            raise ValueError(f"vocab_size={vocab_size}: too small to draw prompt tokens from")
        self.vocab_size, self.seed, self.low = vocab_size, seed, low

    def _draw(self, key: tuple, n: int) -> list[int]:
        rng = np.random.default_rng((self.seed, *key))
        return rng.integers(self.low, self.vocab_size, n).tolist()

    def __call__(self, req: Request) -> list[int]:
        tokens: list[int] = []
        p = req.prefix_block_tokens
        for h in req.prefix_hashes:
            if len(tokens) >= req.prompt_len:
                break
            tokens.extend(self._draw((1, h), p))
        tokens = tokens[:req.prompt_len]
        if len(tokens) < req.prompt_len:
            tokens.extend(self._draw((2, req.id), req.prompt_len - len(tokens)))
        return tokens
