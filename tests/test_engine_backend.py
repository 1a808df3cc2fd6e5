"""backend=engine end to end on the CPU with the tiny model: same files as the simulator,
correct tokens under every policy, and the fault paths."""
from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from testbed.app.entry.cli import CONF_DIR
from testbed.policies import registered
from testbed.app.assembly.run import replay_on_engine, simulate

TINY = ["backend=engine", "model=tiny_llama", "backend.device=cpu"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def config(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_engine_replays_40_azure_requests_like_the_simulator(tmp_path):
    from testbed.app.entry.cli import main  # noqa: F401  (the entry point's module registers the configs)
    from testbed.app.analysis.results import write_results
    from testbed.app.assembly.run import run_info

    common = ["trace.max_requests=40", "trace.rate_scale=20", "trace.max_prompt_len=256", "trace.max_output_len=32"]
    real = replay_on_engine(config(*TINY, *common))
    sim = simulate(config("model=tiny_llama", *common))
    for name, r in (("engine", real), ("sim", sim)):
        write_results(tmp_path / name, r.requests, r.steps, r.summary, "x: 1\n", run_info(r))
    files = lambda d: sorted(p.name for p in (tmp_path / d).iterdir())  # noqa: E731
    assert files("engine") == files("sim")
    e = pd.read_parquet(tmp_path / "engine" / "requests.parquet")
    s = pd.read_parquet(tmp_path / "sim" / "requests.parquet")
    assert list(e.columns) == list(s.columns) and len(e) == len(s) == 40
    summary = json.loads((tmp_path / "engine" / "summary.json").read_text())
    assert summary["completed"] == 40 and summary["backend"] == "engine" and summary["device"] == "cpu"
    assert (e.generated == e.output_len).all() and e.ttft_ms.notna().all()


def crafted_trace(path):
    """Three long prompts at once (they outgrow a 100-block cache: preemption), then three
    that share the first one's 512-token prefix (prefix sharing), all chunked by a 256 budget."""
    rows = [(0, 700, 10, [1, 2]), (0, 650, 10, [3, 4]), (0, 600, 10, [5, 6]),
            (300, 700, 8, [1, 7]), (320, 560, 8, [1, 8]), (340, 530, 8, [1, 9])]
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": p, "output_length": o, "hash_ids": h}) + "\n"
                            for t, p, o, h in rows))
    return path


@pytest.mark.parametrize("policy", sorted(registered()))
def test_engine_tokens_equal_generate_under_every_policy(policy, tmp_path):
    """Greedy tokens from the engine equal transformers' generate, with chunked prefill,
    preemption forced by a small KV cache, and prefix sharing (the Mooncake trace)."""
    check_tokens_against_generate(policy, "cpu", tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the engine's GPU path")
def test_engine_tokens_equal_generate_on_cuda(tmp_path):
    check_tokens_against_generate("vllm", "cuda", tmp_path)


def check_tokens_against_generate(policy, device, tmp_path):
    from testbed.engine.models import build_model
    from testbed.engine.prompts import PromptTokens
    from testbed.engine.setup import build_engine
    from testbed.app.assembly.run_setup import prepare
    from testbed.core.specs import ModelSpec

    cfg = config(*TINY, f"backend.device={device}", f"policy={policy}", "trace=mooncake",
                 f"trace.path={crafted_trace(tmp_path / 't.jsonl')}",
                 "kv.num_blocks=100", "kv.block_size=16", "scheduler.max_num_batched_tokens=256",
                 "kv.enable_prefix_caching=true",  # on whatever the policy's preset says (orca's: off)
                 # vLLM's whole-sequence admission gate off, so that this small cache preempts
                 *(["policy.reserve_full_isl=false"] if policy == "vllm" else []))
    engine = build_engine(cfg, ModelSpec(**{k: v for k, v in cfg.model.items()}))
    setup = prepare(cfg, model=engine.spec, device_blocks=engine.num_blocks)
    loop = setup.make_loop(cfg, engine.num_blocks)
    replay = engine.replay(setup.requests, loop, None, cfg.seed)
    replay.run()
    assert sorted(replay.generated) == [r.id for r in setup.requests]
    reference = build_model(engine.spec, "float32", device, seed=cfg.seed)  # the same seeded random weights
    prompts = PromptTokens(engine.spec.vocab_size, cfg.seed)
    for r in setup.requests:
        ids = torch.tensor([prompts(r)], device=device)
        want = reference.generate(ids, max_new_tokens=r.output_len, min_new_tokens=r.output_len,
                                  do_sample=False)[0, ids.shape[1]:].tolist()
        assert replay.generated[r.id] == want, f"request {r.id} under {policy}"
    # the scenario really exercised chunking, preemption and prefix sharing
    assert max(r.prompt_len for r in setup.requests) > 256
    if policy == "vllm":
        assert sum(s.num_preemptions for s in loop.states) > 0
    assert loop.kv.hit_tokens >= 512  # a later request reused the first one's prefix blocks


def test_model_that_does_not_fit_fails_at_start():
    from testbed.engine.setup import DoesNotFit

    with pytest.raises(DoesNotFit, match=r"weights need .* GB .* GB is usable"):
        replay_on_engine(config("backend=engine", "backend.device=cpu", "model=llama3_8b", "model.dtype=float32",
                                "kv.memory_utilization=0.01", "trace.max_requests=1"))
    with pytest.raises(DoesNotFit, match=r"KV cache of 100000000 blocks .* GB is free"):
        replay_on_engine(config(*TINY, "kv.num_blocks=100000000", "trace.max_requests=1"))


def test_prompt_longer_than_the_context_is_rejected_with_its_reason():
    r = replay_on_engine(config(*TINY, "trace.max_requests=20", "trace.rate_scale=50", "trace.max_output_len=8",
                                "scheduler.max_model_len=600"))
    rejected = r.requests[r.requests.outcome == "rejected"]
    assert len(rejected) > 0 and rejected.reason.str.contains("max_model_len 600").all()
    assert r.summary["completed"] + r.summary["rejected"] == 20


def test_engine_bench_runs_on_cpu(tmp_path, monkeypatch):
    """The GPU benchmark script's code path, on the tiny model (its figures mean nothing here)."""
    import sys

    from testbed.app.profiling import bench

    out = tmp_path / "bench.md"
    monkeypatch.setattr(sys, "argv", ["bench", "--model", "tiny_llama", "--device", "cpu", "--dtype", "float32",
                                      "--small", "--repeats", "2", "--out", str(out)])
    bench.main()
    text = out.read_text()
    assert "decode step, batch 8" in text and "prefill 256 tokens" in text and "16 x (64 in, 16 out)" in text


def tiny_checkpoint(folder, seed=1):
    """A tiny random Llama saved as a local checkpoint (safetensors), as a user's would be."""
    from transformers import AutoModelForCausalLM

    from testbed.engine.models import make_config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config("tiny_llama", num_hidden_layers=3), dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def engine_of(*overrides):
    from testbed.app.assembly.run_setup import _obj
    from testbed.core.specs import ModelSpec
    from testbed.engine.setup import build_engine

    cfg = config(*TINY, *overrides)
    return build_engine(cfg, _obj(cfg.model, ModelSpec))


def test_a_checkpoint_with_random_weights_false_serves_the_files_weights(tmp_path):
    from safetensors.torch import load_file

    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    engine = engine_of("kv.num_blocks=32", f"model.checkpoint={ckpt}", "model.random_weights=false")
    saved = load_file(ckpt / "model.safetensors")
    served = engine.runner.model.state_dict()
    assert saved and set(saved) <= set(served)
    assert all(torch.equal(served[k], saved[k]) for k in saved)
    assert engine.spec.num_layers == 3 and engine.spec.checkpoint == str(ckpt) and not engine.spec.random_weights


def test_a_checkpoint_with_random_weights_true_takes_only_its_shapes(tmp_path):
    from safetensors.torch import load_file

    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    engine = engine_of("kv.num_blocks=32", f"model.checkpoint={ckpt}", "model.random_weights=true")
    saved = load_file(ckpt / "model.safetensors")
    served = engine.runner.model.state_dict()
    assert engine.spec.num_layers == 3 and engine.spec.random_weights  # its shapes, seeded random weights
    assert {k: v.shape for k, v in served.items() if k in saved} == {k: v.shape for k, v in saved.items()}
    assert not torch.equal(served["model.embed_tokens.weight"], saved["model.embed_tokens.weight"])


def test_a_checkpoint_of_pickled_weights_only_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    from testbed.engine.models import make_config

    ckpt = tmp_path / "ckpt"
    model = AutoModelForCausalLM.from_config(make_config("tiny_llama"), dtype=torch.float32)
    model.config.save_pretrained(ckpt)
    torch.save(model.state_dict(), ckpt / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"model.checkpoint=.*ckpt: no safetensors weights .*pytorch_model.bin"):
        engine_of("kv.num_blocks=32", f"model.checkpoint={ckpt}", "model.random_weights=false")


def test_a_checkpoint_folder_without_config_json_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"model.checkpoint=.*nowhere: no config.json there"):
        engine_of("kv.num_blocks=32", f"model.checkpoint={tmp_path / 'nowhere'}", "model.random_weights=false")


def test_the_cpu_kv_cache_takes_no_more_than_it_is_allowed_and_says_so(caplog):
    """A large max_num_seqs and no kv.num_blocks used to take 90% of the host's free memory."""
    import logging

    with caplog.at_level(logging.INFO, logger="testbed.engine"):
        engine = engine_of("scheduler.max_num_seqs=1000000", "kv.cpu_kv_cache_gb=0.01")
    cache = engine.runner.kv_cache
    block = cache.data[:, :, 0].nbytes
    assert engine.num_blocks == int(0.01e9 // block) and cache.data.nbytes <= 0.01e9 + block
    assert f"KV cache: {engine.num_blocks} blocks of 16 tokens" in caplog.text and "kv.cpu_kv_cache_gb=0.01" in caplog.text


@pytest.mark.parametrize("overrides, device, blocks, why", [
    ([], "cpu", 4e9 // 8192, "kv.cpu_kv_cache_gb=4.0"),  # the default bound
    (["scheduler.max_num_seqs=8", "scheduler.max_model_len=100"], "cpu", 8 * 7, "max_num_seqs 8 x max_model_len 100"),
    (["kv.cpu_kv_cache_gb=null"], "cpu", 1e12 * 0.5 // 8192, "kv.memory_utilization"),
    ([], "cuda", 1e12 * 0.5 // 8192, "kv.memory_utilization"),  # a GPU's memory is the run's own
    (["kv.num_blocks=7"], "cpu", 7, "kv.num_blocks"),
])
def test_kv_cache_sizing(overrides, device, blocks, why):
    from testbed.app.assembly.run_setup import _obj
    from testbed.core.specs import ModelSpec
    from testbed.engine.setup import kv_cache_blocks

    cfg = config(*TINY, "scheduler.max_num_seqs=1000000", *overrides)
    got, reason = kv_cache_blocks(cfg, _obj(cfg.model, ModelSpec), torch.device(device), 1e12 * 0.5, 8192)
    assert got == blocks and why in reason
