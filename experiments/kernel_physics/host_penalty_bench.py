"""Host-side cost of vLLM 0.15.1's per-step penalty tensor rebuild, measured on this CPU.

Why: with any repetition/frequency/presence penalty in the batch, vLLM 0.15.1 rebuilds the
padded [B, max_output_len] int64 output-token matrix from Python lists on the host at
every decode step (vllm/v1/sample/ops/penalties.py:42-57 -> vllm/utils/torch_utils.py:439-486:
np.full, then one slice assignment per row from a Python list), and rebuilds the
[B, max_prompt_len] prompt matrix whenever the batch composition changes
(vllm/v1/worker/gpu_input_batch.py:877-892). This script times an equivalent of those two
host steps (no pinning: this machine has no CUDA) so the per-element cost can be quoted.
It reimplements the few numpy lines rather than importing vLLM, which is not installed here.

Run: python experiments/kernel_physics/host_penalty_bench.py
"""

import time

import numpy as np
import torch


def padded_from_lists(rows: list[list[int]], pad: int) -> torch.Tensor:
    """Same work as make_tensor_with_pad(device='cpu', pin_memory=False): full + per-row copy."""
    max_len = max(map(len, rows), default=0)
    out = np.full((len(rows), max_len), pad, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return torch.from_numpy(out)


def prompt_matrix(token_ids_cpu: np.ndarray, prompt_lens: np.ndarray, pad: int) -> torch.Tensor:
    """Same work as InputBatch._make_prompt_token_ids_tensor without pinning / H2D."""
    b = len(prompt_lens)
    max_len = int(prompt_lens.max())
    out = torch.empty((b, max_len), dtype=torch.int64)
    arr = out.numpy()
    arr[:] = token_ids_cpu[:b, :max_len]
    for i in range(b):
        arr[i, prompt_lens[i]:] = pad
    return out


def best_of(fn, reps: int = 7) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    vocab = 152064
    rng = np.random.default_rng(0)
    print("op,batch,len,ms,ns_per_element")
    for b in (32, 128, 256, 512):
        for length in (256, 1024, 4096):
            rows = [rng.integers(0, vocab, length).tolist() for _ in range(b)]
            ms = best_of(lambda: padded_from_lists(rows, vocab)) * 1e3
            print(f"output_rebuild,{b},{length},{ms:.3f},{ms * 1e6 / (b * length):.2f}")
            tok = rng.integers(0, vocab, (b, length + 8))
            lens = np.full(b, length)
            ms = best_of(lambda: prompt_matrix(tok, lens, vocab)) * 1e3
            print(f"prompt_rebuild,{b},{length},{ms:.3f},{ms * 1e6 / (b * length):.2f}")


if __name__ == "__main__":
    main()
