"""cost_model=kernels: the measured-table interpolation and the step composed from it."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from testbed.core.cost import BatchShape, add_work
from testbed.core.specs import HardwareSpec, ModelSpec, ParallelSpec
from testbed.sim.kernel_db import INSTALL_HINT, HeadsMatch, KernelDB, LogGrid, match_heads

HAS_DB = importlib.util.find_spec("aiconfigurator_core") is not None
needs_db = pytest.mark.skipif(not HAS_DB, reason="aiconfigurator-core (the measured kernel tables) is not installed")
# the other tests read h100_sxm's tables, which ship inside the package (testbed/sim/kernel_data)

LLAMA2_7B = dict(name="llama2-7b", hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                 num_kv_heads=32, head_dim=128, vocab_size=32000)


def shape(work) -> BatchShape:
    s = BatchShape()
    add_work(s, work)
    return s


@pytest.fixture(scope="module")
def db():
    return KernelDB("h100_sxm", "vllm")


def cost(db, model=None, tp=1, pp=1, **kw):
    from testbed.sim.kernel_cost import KernelCostModel

    return KernelCostModel(model or ModelSpec(**LLAMA2_7B), HardwareSpec(kernel_db_gpu="h100_sxm"),
                           ParallelSpec(tp, pp), db, max_tokens=4096, **kw)


# ---------------------------------------------------------------- the interpolator, on a grid built here
def test_grid_is_exact_on_nodes_and_between_neighbours_off_them():
    m, n = np.array([1.0, 4, 16, 64]), np.array([128.0, 1024])
    lat = np.outer(1 + m / 8, n / 128) * 1e-6
    grid = LogGrid([m, n], lat, up=(1, 1))
    for i, mi in enumerate(m):
        for j, nj in enumerate(n):
            assert grid(mi, nj) == pytest.approx(lat[i, j])
    mid = grid(8, 300)
    lo, hi = sorted([grid(4, 128), grid(16, 1024)])
    assert lo < mid < hi
    # past the top an axis scales its work; below the bottom the launch floor holds
    assert grid(128, 1024) == pytest.approx(2 * grid(64, 1024))
    assert grid(0.5, 128) == pytest.approx(grid(1, 128))


def test_unmeasured_cells_are_filled_from_both_neighbours():
    axis = np.array([1.0, 2, 4])
    full = np.array([1.0, 2.0, 4.0]) * 1e-5
    holed = full.copy()
    holed[1] = np.nan
    grid = LogGrid([axis], holed, up=(1,))
    assert full[0] < grid(2) < full[2]


def test_heads_stand_in_keeps_the_group_ratio_and_scales_the_batch():
    got = match_heads(32, 32, [(8, 8), (32, 8), (4, 4)])
    assert (got.heads, got.kv_heads, got.batch_factor) == (8, 8, 4.0)
    assert match_heads(32, 8, [(8, 8), (32, 8)]).batch_factor == 1.0
    # Qwen2.5-7B's 28 heads over 4 kv heads: a prompt's work is per query head, a decode's per kv head
    assert match_heads(28, 4, [(24, 4), (32, 4), (32, 8)]) == HeadsMatch(32, 4, 28 / 32)
    assert match_heads(28, 4, [(24, 4), (32, 4), (32, 8)], decode=True) == HeadsMatch(32, 4, 1.0)
    assert match_heads(32, 32, [(8, 8), (32, 8)], decode=True).batch_factor == 4.0


def test_decode_attention_reads_kv_per_kv_head_whatever_the_query_heads(db):
    """The measured tables behind match_heads(decode=True): at fixed kv heads decode attention's time does
    not follow the query heads; it follows the kv heads."""
    grid = {hk: db.attention_grid("generation", *hk, 128)[0] for hk in [(8, 4), (32, 4), (64, 4), (32, 8)]}
    t = {hk: g(32.0, 4096.0) for hk, g in grid.items()}
    assert t[(8, 4)] == pytest.approx(t[(64, 4)], rel=0.05) and t[(32, 4)] == pytest.approx(t[(64, 4)], rel=0.05)
    assert 1.5 < t[(32, 8)] / t[(32, 4)] < 2.1
    qwen = db.attention_grid("generation", 28, 4, 128)[1]
    assert (qwen.kv_heads, qwen.batch_factor) == (4, 1.0)


# ---------------------------------------------------------------- the real tables
def test_measured_point_is_returned_and_off_grid_lies_between(db):
    import pandas as pd

    path = db._path("gemm")
    df = pd.read_parquet(path, filters=[("kernel_source", "==", "torch.nn.functional.linear"),
                                        ("gemm_dtype", "==", "bfloat16"), ("n", "==", 4096), ("k", "==", 4096)])
    # a measured point, or the slowest measured at fewer rows where noise made it faster (monotone in m)
    row = df[df.m <= 64].groupby("m").latency.median().max() * 1e-3
    assert db.gemm(64, 4096, 4096) == pytest.approx(row)
    a, b = db.gemm(64, 4096, 4096), db.gemm(96, 4096, 4096)
    assert min(a, b) <= db.gemm(80.5, 4096, 4096) <= max(a, b)


def test_gemm_grows_with_m(db):
    ms = np.array([1, 256, 1024, 4096, 16384, 65536])
    t = db.gemm_over_m(4096, 4096, ms)
    assert np.all(np.diff(t) > 0)
    assert np.allclose(t, [db.gemm(m, 4096, 4096) for m in ms])
    # never below a smaller GEMM, whatever the tables' noise (vLLM 0.14.0's LM head rows: 0.43 ms at 1 row, 0.36 at 8)
    lm = KernelDB("h100_sxm", near="0.15.1").gemm_over_m(128256, 4096, np.arange(1, 65, dtype=float))
    assert np.all(np.diff(lm) >= 0)


def test_tensor_parallel_halves_gemm_work_and_adds_all_reduce(db):
    prefill = shape([(0, 2048, False)])
    one, two = cost(db, tp=1), cost(db, tp=2)
    assert two.step_time(prefill) < one.step_time(prefill)
    # the per-GPU layer GEMMs halve (within the kernels' efficiency curve), the all-reduces come on top
    linear_one = one._layer_token_costs(np.array([2048.0]))[0]
    ar = two._allreduce(np.array([2048.0]))[0]
    assert ar > 0
    linear_two = two._layer_token_costs(np.array([2048.0]))[0] - 2 * ar
    assert 0.4 < linear_two / linear_one < 0.65


def test_moe_step_costs_less_than_all_experts_dense(db):
    moe = ModelSpec(name="mixtral", hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                    num_kv_heads=8, head_dim=128, vocab_size=32000, num_experts=8, num_experts_per_tok=2)
    dense_all = ModelSpec(**{**moe.__dict__, "num_experts": 0, "num_experts_per_tok": 0,
                             "intermediate_size": 8 * 14336})
    for work in ([(0, 1024, False)], [(500, 1, True)] * 16):
        assert cost(db, moe, tp=2).step_time(shape(work)) < cost(db, dense_all, tp=2).step_time(shape(work))


def test_moe_routing_skew_is_read_from_its_own_rows_and_falls_back_to_balanced():
    """cost_model.moe_distribution: a skewed routing's rows where the table measured them (vLLM 0.14.0's H100
    table: a prefill-sized MoE waits for its busiest expert), balanced rows where it did not, said either way."""
    tokens = np.array([256.0, 1024.0, 2048.0])
    args = (tokens, 4096, 14336, 2, 8, 2, 989e12, 3.35e12)
    skew, even = (KernelDB("h100_sxm", near="0.15.1", moe_distribution=d) for d in ("power_law_1.2", "balanced"))
    slower = skew.moe_over_tokens(*args) / even.moe_over_tokens(*args)
    assert (slower > 1.03).all() and (slower < 1.3).all(), slower
    moe = ModelSpec(name="mixtral", hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                    num_kv_heads=8, head_dim=128, vocab_size=32000, num_experts=8, num_experts_per_tok=2)
    prefill = shape([(0, 1024, False)])
    assert cost(skew, moe, tp=2).step_time(prefill) > cost(even, moe, tp=2).step_time(prefill)
    assert skew.moe_distribution_used == {"bfloat16": "power_law_1.2"} and skew.versions["moe"] == "0.14.0"
    assert skew.reads["moe"][2][1] == ("distribution", "==", "power_law_1.2")
    h200 = KernelDB("h200_sxm", moe_distribution="power_law_1.2")  # the packaged tables keep balanced rows only
    assert h200.moe_over_tokens(*args).shape == (3,) and h200.moe_distribution_used == {"bfloat16": "balanced"}
    with pytest.raises(ValueError, match=r"cost_model.moe_distribution='zipf': expected one of balanced, "):
        KernelDB("h100_sxm", moe_distribution="zipf")


def test_moe_routing_reaches_the_summary(tmp_path):
    from hydra import compose, initialize_config_dir

    from testbed.app.entry.cli import CONF_DIR
    from testbed.app.assembly.run import simulate

    for dist in ("power_law_1.2", "balanced"):
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=["model=mixtral_8x7b", "parallel.tensor_parallel_size=2",
                                               f"cost_model.moe_distribution={dist}", "trace.max_requests=60",
                                               f"output.dir={tmp_path / dist}"])
        s = simulate(cfg).summary
        assert s["cost_model_data"]["moe_routing"] == {"bfloat16": dist} and s["completed"] == 60
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["model=llama3_1_8b", "trace.max_requests=5", f"output.dir={tmp_path / 'dense'}"])
    assert "moe_routing" not in simulate(cfg).summary["cost_model_data"]  # a dense model reads no MoE table


def test_overheads_and_pipeline_add_up(db):
    decode = shape([(799, 1, True)] * 8)
    base = cost(db).step_time(decode)
    with_over = cost(db, step_overhead_s=1e-3, layer_overhead_s=1e-5, seq_overhead_s=1e-5).step_time(decode)
    assert with_over == pytest.approx(base + 1e-3 + 32 * 1e-5 + 8 * 1e-5)
    assert cost(db, kernel_scale=2).step_time(decode) == pytest.approx(2 * base)
    assert cost(db, pp=2).step_time(decode) < base  # half the layers per stage, one hand-off


@needs_db  # an unknown GPU is looked up in the installed package (none is shipped for it)
def test_unknown_gpu_and_head_dim_are_named(db):
    from testbed.sim.kernel_db import KernelDBError

    with pytest.raises(KernelDBError, match="h100_sxm"):
        KernelDB("no_such_gpu")
    with pytest.raises(KernelDBError, match="head_dim=80"):
        cost(db, ModelSpec(**{**LLAMA2_7B, "head_dim": 80}))


def test_simulation_with_kernels_finishes(tmp_path):
    from hydra import compose, initialize_config_dir

    from testbed.app.entry.cli import CONF_DIR
    from testbed.app.assembly.run import simulate

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["cost_model=kernels", "hardware.kernel_db_gpu=h100_sxm",
                                           "trace.max_requests=300", f"output.dir={tmp_path}"])
        res = simulate(cfg)
        assert res.summary["cost_model"] == "kernels"
        assert res.summary["completed"] == 300
        cfg = compose("config", overrides=["cost_model=kernels", "hardware.kernel_db_gpu=null", "cost_model.fallback=null",
                                           "trace.max_requests=10", f"output.dir={tmp_path}"])
        with pytest.raises(ValueError, match="hardware.kernel_db_gpu is not set"):
            simulate(cfg)


def test_without_the_package_a_gpu_not_shipped_raises_the_install_hint(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError) as err:
        KernelDB("rtx_pro_6000_server")
    assert str(err.value).startswith(INSTALL_HINT)
    assert KernelDB("h100_sxm").source.kind == "shipped"  # the presets' GPUs: tests/test_kernel_tables.py


@needs_db
def test_host_work_hides_behind_the_gpu_under_async_scheduling_and_adds_without_it(db):
    """vLLM's engine-core host work per step (experiments/host_overhead/: a + b x sequences) runs while the
    GPU executes the previous step when async scheduling is on: a step takes max(GPU, host); off, GPU + host."""
    s = shape([(1000, 1, True)] * 8)
    gpu = cost(db).step_time(s)
    small, big = dict(host_step_s=1e-4, host_seq_s=1e-6), dict(host_step_s=gpu, host_seq_s=1e-4)
    assert cost(db, async_scheduling=True, **small).step_time(s) == gpu  # hidden
    assert cost(db, async_scheduling=True, **big).step_time(s) == pytest.approx(gpu + 8e-4)  # host-bound
    assert cost(db, async_scheduling=False, **small).step_time(s) == pytest.approx(gpu + 1e-4 + 8e-6)
    with pytest.raises(ValueError, match="host_seq_s=-1"):
        cost(db, host_seq_s=-1.0)
