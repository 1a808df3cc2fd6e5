"""The floor the engine's steps are measured against: a bare Llama forward in plain torch.

Issue 4 set the engine's speed targets against "a bare Llama forward (fused QKV, SDPA over a
flat cache, SwiGLU)" with decode steps replayed as CUDA graphs. Those figures were measured on
another machine with other versions, so the bench (`testbed/app/profiling/bench.py`) measures this floor
itself, on the same device, dtype and shapes, in the same process: the ratio engine / plain is
then the engine's own overhead (paged KV gathers, transformers' module dispatch, the step
loop's input preparation), not a difference between machines.

What it leaves out is what the engine must do and a bare forward need not: no paging (one
contiguous cache per sequence), no batch of mixed lengths (every sequence in a step has the
same context), no input preparation on the host. Weights are taken from a transformers Llama
or Mistral model (`from_hf`), so a test can check that it computes the same logits; only
bias-free attention and full (not sliding-window) attention are supported.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


class PlainLlama:
    def __init__(self, embed: torch.Tensor, layers: list[dict], norm: torch.Tensor, lm_head: torch.Tensor,
                 inv_freq: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 rope_scale: float = 1.0):
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.inv_freq = inv_freq.float()
        self.rope_scale = rope_scale
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, eps
        self.device, self.dtype = embed.device, embed.dtype
        self.k = self.v = None  # the flat cache: [layers, batch, kv heads, tokens, head_dim] each

    @classmethod
    @torch.no_grad()
    def from_hf(cls, model) -> "PlainLlama":
        """The weights of a transformers Llama/Mistral causal LM: q/k/v and gate/up fused (those two
        are copies), the others shared with the model."""
        c = model.config
        if c.model_type not in ("llama", "mistral") or getattr(c, "attention_bias", False) \
                or getattr(c, "mlp_bias", False) or getattr(c, "sliding_window", None):
            raise ValueError(f"PlainLlama: {c.model_type} is not a bias-free, full-attention Llama or Mistral")
        m = model.model
        layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            layers.append({
                "ln1": layer.input_layernorm.weight, "ln2": layer.post_attention_layernorm.weight,
                "qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                "o": a.o_proj.weight, "down": mlp.down_proj.weight,
                "gate_up": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
            })
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        rotary = m.rotary_emb
        return cls(m.embed_tokens.weight, layers, m.norm.weight, model.lm_head.weight,
                   rotary.inv_freq, heads, c.num_key_value_heads, head_dim, c.rms_norm_eps,
                   float(getattr(rotary, "attention_scaling", 1.0)))

    @contextlib.contextmanager
    def cache(self, batch: int, tokens: int):
        """A flat KV cache for `batch` sequences of up to `tokens` tokens, freed on exit."""
        shape = (len(self.layers), batch, self.num_kv_heads, tokens, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        try:
            yield
        finally:
            self.k = self.v = None

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x * cos + rotated * sin).to(x.dtype)

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """One step: `ids` [batch, n] are the tokens at positions start..start+n-1 of every
        sequence (prefill: start 0; decode: n 1); the last position's logits [batch, vocab],
        float32. Keys and values are written into the cache (`with model.cache(...)`)."""
        b, n = ids.shape
        if n > 1 and start != 0:
            raise ValueError("PlainLlama: a prefill starts at position 0")
        if self.k is None or self.k.shape[1] < b or self.k.shape[3] < start + n:
            raise ValueError(f"PlainLlama: no cache for {b} sequences of {start + n} tokens (use model.cache)")
        nh, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        pos = torch.arange(start, start + n, device=self.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq.to(self.device))
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = (emb.cos() * self.rope_scale).to(self.dtype)[None, None]
        sin = (emb.sin() * self.rope_scale).to(self.dtype)[None, None]
        x = self.embed[ids]  # [b, n, hidden]
        hidden = x.shape[-1]
        end = start + n
        for i, w in enumerate(self.layers):
            h = F.rms_norm(x, (hidden,), w["ln1"], self.eps)
            q, k, v = F.linear(h, w["qkv"]).split([nh * hd, kvh * hd, kvh * hd], dim=-1)
            q = self._rope(q.view(b, n, nh, hd).transpose(1, 2), cos, sin)
            k = self._rope(k.view(b, n, kvh, hd).transpose(1, 2), cos, sin)
            self.k[i, :b, :, start:end] = k
            self.v[i, :b, :, start:end] = v.view(b, n, kvh, hd).transpose(1, 2)
            keys, values = self.k[i, :b, :, :end], self.v[i, :b, :, :end]
            if n == 1:  # decode: the heads sharing a KV head are that head's query rows, no mask
                o = F.scaled_dot_product_attention(q.reshape(b, kvh, nh // kvh, hd), keys, values)
            else:
                group = nh // kvh
                o = F.scaled_dot_product_attention(q, keys.repeat_interleave(group, dim=1),
                                                   values.repeat_interleave(group, dim=1), is_causal=True)
            x = x + F.linear(o.reshape(b, nh, n, hd).transpose(1, 2).reshape(b, n, nh * hd), w["o"])
            h = F.rms_norm(x, (hidden,), w["ln2"], self.eps)
            gate, up = F.linear(h, w["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w["down"])
        h = F.rms_norm(x[:, -1], (hidden,), self.norm, self.eps)
        return F.linear(h, self.lm_head).float()

    def step(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """One step's greedy token ids [batch], on the device."""
        return self.logits(ids, start).argmax(-1)

    def captured_step(self, ids: torch.Tensor, start: int):
        """`step(ids, start)` captured as a CUDA graph: a function that replays it and returns its
        token ids on the host. `ids` is the graph's input buffer (fill it in place to change them)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up outside the graph (lazy inits, allocator)
            self.step(ids, start)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.step(ids, start)

        def replay() -> list[int]:
            graph.replay()
            return out.tolist()

        return replay
