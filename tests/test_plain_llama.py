"""The bench's plain-torch floor computes what the model computes: with a transformers model's
own weights it gives the same logits and the same greedy tokens, so the engine is never
compared against a forward that skips work."""
from __future__ import annotations

import pytest
import torch

from testbed.app.profiling.plain_llama import PlainLlama
from testbed.engine.models import build_model, make_config


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    # 10x the usual init scale, as in test_engine_runner: a wrong head grouping, RoPE or mask flips the argmax
    return build_model(make_config("tiny_llama", initializer_range=0.2), dtype=torch.float32, seed=0)


def test_plain_forward_equals_transformers_logits_and_greedy_tokens(model):
    plain = PlainLlama.from_hf(model)
    ids = torch.randint(0, 512, (3, 20), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)[:, 20:]
    with plain.cache(3, 28):
        torch.testing.assert_close(plain.logits(ids, 0), model(ids).logits[:, -1], rtol=1e-4, atol=1e-4)
        out = [plain.step(ids, 0)]
        for i in range(7):  # decode steps over the flat cache (4 query heads on 2 KV heads)
            out.append(plain.step(out[-1][:, None], 20 + i))
    assert torch.equal(torch.stack(out, 1), ref)


def test_plain_refuses_what_it_does_not_compute():
    qwen = build_model(make_config("tiny_qwen2"), dtype=torch.float32)
    with pytest.raises(ValueError, match="qwen2 is not a bias-free, full-attention Llama"):
        PlainLlama.from_hf(qwen)
    plain = PlainLlama.from_hf(build_model(make_config("tiny_llama"), dtype=torch.float32))
    with pytest.raises(ValueError, match="no cache for 2 sequences of 9 tokens"):
        with plain.cache(1, 8):
            plain.step(torch.zeros(2, 9, dtype=torch.long), 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the bench's CUDA-graph decode step")
def test_plain_decode_graph_replays_the_eager_step():
    """The bench times plain decode steps as graph replays: the replay gives the eager step's tokens."""
    cuda = build_model(make_config("tiny_llama", initializer_range=0.2), dtype=torch.float32, seed=0, device="cuda")
    plain = PlainLlama.from_hf(cuda)
    prompt = torch.randint(0, 512, (4, 30), generator=torch.Generator().manual_seed(2)).cuda()
    with plain.cache(4, 31):
        ids = plain.step(prompt, 0)[:, None].clone()
        eager = plain.step(ids, 30).tolist()
        replay = plain.captured_step(ids, 30)
        assert replay() == eager == replay()
