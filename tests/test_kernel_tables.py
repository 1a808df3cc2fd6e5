"""The validated configuration as the default: the kernel tables shipped inside the package (their
step times bit-identical to the installed aiconfigurator-core's), where tables are read from, the
roofline standing in where no table can price a run, async scheduling at vLLM's own default, and
the summary naming what produced every number."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from testbed.app.entry.cli import CONF_DIR
from testbed.core.cost import BatchShape
from testbed.core.specs import HardwareSpec, ModelSpec, ParallelSpec
from testbed.sim.kernel_db import INSTALL_HINT, SHIPPED_DIR, KernelDB, KernelDBError, find_tables, shipped_gpus

HAS_PACKAGE = importlib.util.find_spec("aiconfigurator_core") is not None
needs_package = pytest.mark.skipif(not HAS_PACKAGE, reason="aiconfigurator-core is not installed")


def config(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=["output.progress=false", *overrides])


def preset(group: str, name: str) -> dict:
    node = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{name}.yaml"))
    node.pop("defaults", None)
    return node


def shapes() -> list[BatchShape]:
    """Decode batches small and large, prefills short and long, mixed steps, past the tables' top."""
    out = []
    for prefill, seqs, decodes, ctx in [(0, 0, 1, 100), (0, 0, 64, 900), (0, 0, 256, 2000), (512, 1, 0, 0),
                                        (4096, 2, 30, 3000), (8192, 1, 0, 0), (17, 1, 200, 5000), (20000, 3, 0, 0)]:
        s = BatchShape()
        s.num_prefill_tokens, s.num_prefill_seqs = prefill, seqs
        s.prefill_attn_pairs = prefill * (prefill / max(seqs, 1) + 1) / 2 if seqs else 0
        s.num_decode_seqs, s.decode_kv_tokens = decodes, decodes * ctx
        out.append(s)
    return out


# every hardware preset's GPU; dense, grouped-query, MoE; bf16, fp8 weights and KV, int4; TP 1-8
MODELS = [("llama3_1_8b", 1, None, "auto"), ("llama3_1_70b", 4, None, "auto"), ("mixtral_8x7b", 2, None, "auto"),
          ("qwen3_30b_a3b", 1, None, "auto"), ("llama3_1_8b", 1, "fp8", "fp8"), ("llama3_1_70b", 8, "int4", "auto"),
          ("qwen3_30b_a3b", 2, "fp8", "auto"), ("qwen2_5_7b", 1, None, "auto"), ("mistral_nemo_12b", 2, None, "auto")]


@needs_package
@pytest.mark.parametrize("hardware", ["h100", "h200", "a100", "l40s", "b200"])
def test_shipped_tables_give_the_installed_packages_step_times_bit_for_bit(hardware):
    from testbed.sim.kernel_cost import KernelCostModel
    from testbed.sim.kernel_db import package_data_dir

    hw = HardwareSpec(**preset("hardware", hardware))
    priced = 0
    for name, tp, weights, kv in MODELS:
        spec = dict(preset("model", name), weight_dtype=weights, kv_cache_dtype=kv)
        got = []
        for data_dir in (None, package_data_dir()):
            db = KernelDB(hw.kernel_db_gpu, "vllm", data_dir=data_dir)
            try:
                cost = KernelCostModel(ModelSpec(**spec), hw, ParallelSpec(tp, 1), db, max_tokens=8192)
            except KernelDBError:  # (the A100's tables have no MoE or fp8 rows: neither source can price it)
                got.append(None)
                continue
            got.append(([cost.step_time(s) for s in shapes()], db.versions, db.sources_used, db.source.kind))
        shipped, installed = got
        assert (shipped is None) == (installed is None), (name, tp, weights, kv)
        if shipped is not None:
            assert shipped[3] == "shipped" and installed[3] == "data_dir"
            assert shipped[:3] == installed[:3], (name, tp, weights, kv)  # == on floats: bit for bit
            priced += 1
    assert priced >= (5 if hardware == "a100" else len(MODELS))


@needs_package
def test_the_shipped_folder_is_what_the_export_writes(tmp_path):
    from testbed.sim.kernel_export import _same, export

    m = export(tmp_path)
    assert _same(SHIPPED_DIR, tmp_path) == []
    assert sorted(m["gpus"]) == shipped_gpus() == ["a100_sxm", "b200_sxm", "h100_sxm", "h200_sxm", "l40s"]


def test_the_shipped_tables_say_where_they_come_from():
    manifest = json.loads((SHIPPED_DIR / "manifest.json").read_text())
    assert manifest["package"] == "aiconfigurator-core" and manifest["license"] == "Apache-2.0"
    notice = (SHIPPED_DIR / "NOTICE.md").read_text()
    assert f"aiconfigurator-core {manifest['version']}" in notice and "Apache License, Version 2.0" in notice
    assert "Apache License" in (SHIPPED_DIR / "LICENSE-aiconfigurator-core").read_text()
    for gpu, fws in manifest["gpus"].items():  # every file the manifest lists is there, with its rows
        import pandas as pd

        for rel, info in fws["vllm"]["files"].items():
            assert len(pd.read_parquet(SHIPPED_DIR / rel)) == info["rows"] <= info["of_rows"], rel


def test_the_upstream_tables_say_where_they_come_from():
    up = json.loads((SHIPPED_DIR / "upstream.json").read_text())
    assert up["license"] == "Apache-2.0" and len(up["commit"]) == 40 and "upstream repository" in \
        (SHIPPED_DIR / "NOTICE-upstream.md").read_text()
    import pandas as pd

    for rel, info in up["files"].items():
        assert len(pd.read_parquet(SHIPPED_DIR / rel)) == info["rows"], rel


@pytest.mark.parametrize("near, expected", [(None, "0.24.0"), ("0.15.1", "0.14.0"), ("0.23.0", "0.24.0"),
                                            ("0.19.0", "0.14.0")])  # a tie (5 from each) goes to the older
def test_each_op_reads_the_table_version_nearest_the_simulated_release(near, expected):
    db = KernelDB("h100_sxm", "vllm", near=near)
    db.gemm_over_m(4096, 4096, np.array([8.0]))
    db.attention_grid("generation", 32, 8, 128)
    assert db.versions["gemm"] == db.versions["generation_attention"] == expected
    # the older tables name the same kernels by their older names
    assert db.sources_used["generation_attention"] == ("vllm_flash_attn" if expected == "0.14.0" else "vllm_flash_attn_fa3")


def test_the_tables_are_read_from_data_dir_then_shipped_then_the_package(tmp_path, monkeypatch):
    assert find_tables("h100_sxm", "vllm", data_dir=tmp_path).kind == "data_dir"
    assert find_tables("h100_sxm", "vllm").kind == "shipped"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # no aiconfigurator-core
    db = KernelDB("h100_sxm", "vllm")
    assert db.source.kind == "shipped" and db.gemm(1, 4096, 4096) > 0
    for gpu, version, why in [("l4", None, "ships vllm tables for a100_sxm, b200_sxm, h100_sxm, h200_sxm, l40s only"),
                              ("h100_sxm", "0.19.0", "framework_version='0.19.0' is not among the shipped tables")]:
        with pytest.raises(ImportError) as err:
            KernelDB(gpu, "vllm", version)
        assert str(err.value).startswith(INSTALL_HINT) and why in str(err.value)
    with pytest.raises(ImportError):  # SGLang's tables are not shipped
        KernelDB("h100_sxm", "sglang")


@needs_package
def test_other_gpus_and_versions_come_from_the_package():
    assert find_tables("rtx_pro_6000_server", "vllm").kind == "installed"
    assert find_tables("h100_sxm", "vllm", "0.24.0").kind == "installed"
    assert KernelDB("h100_sxm", "vllm", kernel_sources={"gemm": "sglang_torch_linear"}).source.kind == "installed"


# ---------------------------------------------------------------- the default configuration
def test_the_default_is_the_validated_configuration():
    cfg = config()
    assert (cfg.model.name, cfg.hardware.name, cfg.cost_model.name, cfg.frontend.name) == \
        ("llama3.1-8b", "h100-sxm", "kernels", "vllm_api")
    assert cfg.backend.async_scheduling is None and cfg.cost_model.fallback == "roofline"


def test_the_main_command_says_it_ran_the_validated_configuration(tmp_path):
    from testbed.app.assembly.provenance import line
    from testbed.app.assembly.run import simulate

    s = simulate(config("trace.max_requests=50", f"output.dir={tmp_path}")).summary
    assert s["cost_model"] == "kernels" and s["frontend"] == "vllm_api" and s["async_scheduling"] is True
    assert s["cost_model_data"]["source"] == "shipped" and s["cost_model_data"]["gpu"] == "h100_sxm"
    assert s["cost_model_data"]["versions"]["gemm"] == "0.14.0"  # nearest the simulated vLLM 0.15.1
    assert s["validated_configuration"] is True and s["differs_from_validated"] == []
    assert s["sampler"] == "sort"  # Llama-3.1-8B-Instruct's generation_config.json: temperature 0.6, top-p 0.9
    assert line(s).startswith("validated configuration: llama3.1-8b on h100-sxm, cost_model=kernels "
                              "(aiconfigurator-core 0.12.0 and aiconfigurator @ 095f58a vLLM tables for h100_sxm), sampler: sort, "
                              "frontend=vllm_api, async scheduling")


@pytest.mark.parametrize("overrides, path", [(["sampling.temperature=0"], "greedy"),
                                             (["sampling.generation_config=vllm"], "random"),
                                             (["model=mistral_nemo_12b"], "random"),  # its file sets nothing
                                             (["model=qwen2_5_7b"], "sort+penalties")])
def test_the_summary_names_the_samplers_path(overrides, path, tmp_path):
    from testbed.app.assembly.run import simulate

    s = simulate(config("trace.max_requests=5", f"output.dir={tmp_path}", *overrides)).summary
    assert s["sampler"] == path


@pytest.mark.parametrize("overrides, differs", [
    (["frontend=none"], ["frontend=none"]),
    (["cost_model.kernel_scale=1.2"], [f"cost_model.kernel_scale=1.2 (shipped: {preset('cost_model', 'kernels')['kernel_scale']})"]),
    (["backend.async_scheduling=false"], ["async scheduling off"]),
    (["spec_decode.method=ngram"], ["async scheduling off (vLLM's default with ngram or draft-model speculative decoding)"]),
    (["cost_model=roofline"], ["cost_model=roofline"]),
    (["hardware=a100"], ["kernel tables of a100_sxm (the validation runs are on H100: h100_sxm)"]),
])
def test_the_summary_names_what_differs_from_the_validated_configuration(overrides, differs, tmp_path):
    from testbed.app.assembly.provenance import line
    from testbed.app.assembly.run import simulate

    s = simulate(config("trace.max_requests=20", f"output.dir={tmp_path}", *overrides)).summary
    assert s["validated_configuration"] is False and s["differs_from_validated"] == differs
    assert line(s).startswith("configuration: ") and differs[0] in line(s)


def test_without_tables_the_roofline_stands_in_and_the_summary_says_so(tmp_path, caplog):
    from testbed.app.assembly.provenance import line
    from testbed.app.assembly.run import simulate

    r = simulate(config("hardware=cpu", "trace.max_requests=20", f"output.dir={tmp_path}"))
    s = r.summary
    assert s["cost_model"] == "roofline" and "hardware.kernel_db_gpu is not set for cpu" in s["cost_model_fallback"]
    assert "cost_model_data" not in s and "roofline stands in" in caplog.text
    assert "cost_model=roofline standing in for cost_model=kernels" in line(s)
    # the very results of asking for the roofline
    plain = simulate(config("hardware=cpu", "cost_model=roofline", "trace.max_requests=20", f"output.dir={tmp_path}"))
    assert r.requests.equals(plain.requests) and r.steps.equals(plain.steps)
    # a model the tables cannot price (float32) on a GPU that has them falls back too
    s = simulate(config("model=tiny_llama", "trace.max_requests=20", f"output.dir={tmp_path}")).summary
    assert s["cost_model"] == "roofline" and "bf16 only" in s["cost_model_fallback"]


@pytest.mark.parametrize("overrides, words", [
    (["hardware=cpu"], "hardware.kernel_db_gpu is not set for cpu"),
    (["model=tiny_llama"], "the kernel tables used are bf16 only"),
    (["hardware.kernel_db_gpu=no_such_gpu"], "no_such_gpu"),
])
def test_fallback_null_makes_missing_tables_an_error(overrides, words, tmp_path):
    from testbed.app.assembly.run import simulate

    with pytest.raises((KernelDBError, ImportError), match=words):
        simulate(config("cost_model.fallback=null", "trace.max_requests=5", f"output.dir={tmp_path}", *overrides))


def test_validation_never_scores_a_stand_in():
    from testbed.app.analysis.real_runs import RealRun  # noqa: F401  (the run type run_config takes)
    from testbed.app.analysis.validate_replay import run_config

    class Run:  # the fields run_config reads
        tensor_parallel, pipeline_parallel, max_num_batched_tokens, max_num_seqs = 1, 1, 2048, 256
        max_model_len, gpu_memory_utilization, async_scheduling, model_config, stages = 4096, 0.9, True, "x", []
        model_id = "meta-llama/Llama-2-7b-hf"

    assert run_config(config(), Run()).cost_model.fallback is None


# ---------------------------------------------------------------- async scheduling: vLLM's default
@pytest.mark.parametrize("overrides, expected", [
    ([], True),
    (["backend.async_scheduling=false"], False),
    (["spec_decode.method=ngram"], False),  # vLLM turns it off for non-EAGLE speculative decoding
    (["spec_decode.method=ngram", "backend.async_scheduling=true"], True),
    (["disagg.enabled=true"], False),  # not modelled with disaggregation
])
def test_async_scheduling_null_is_vllms_default(overrides, expected):
    from testbed.app.assembly.run_setup import async_scheduling

    assert async_scheduling(config(*overrides)) is expected


def test_disaggregation_runs_at_the_default_and_records_async_off(tmp_path):
    from testbed.app.assembly.run import simulate

    s = simulate(config("disagg.enabled=true", "trace.max_requests=20", f"output.dir={tmp_path}")).summary
    assert s["async_scheduling"] is False
    assert "async scheduling off (not modelled with disaggregated pools)" in s["differs_from_validated"]
    with pytest.raises(ValueError, match="async_scheduling=true: not modelled with disagg"):
        simulate(config("disagg.enabled=true", "backend.async_scheduling=true", "trace.max_requests=5"))


def test_the_disaggregation_search_compares_layouts_without_async_scheduling_alike():
    from testbed.app.analysis.disagg_search import layout_config
    from testbed.app.assembly.run_setup import async_scheduling

    for prefill, decode in ((0, 4), (1, 3)):
        assert async_scheduling(layout_config(config(), prefill, decode, 1.0)) is False


# ---------------------------------------------------------------- the other backends keep working
@pytest.mark.parametrize("backend", ["engine", "vllm"])
def test_the_engine_and_vllm_backends_default_to_no_front_end(backend):
    from testbed.app.assembly.validate import check_config

    cfg = config(f"backend={backend}", "model=tiny_llama")
    assert cfg.frontend.name == "none" and cfg.frontend.request_s == 0 and cfg.backend.async_scheduling is None
    check_config(cfg)  # nothing simulator-only is set
    from testbed.app.assembly.validate import ConfigError

    with pytest.raises(ConfigError, match=r"frontend.request_s=.*the simulator's only"):
        check_config(config(f"backend={backend}", "model=tiny_llama", "frontend=vllm_api"))
    with pytest.raises(ConfigError, match=r"backend.async_scheduling=true: the simulator's only"):
        check_config(config(f"backend={backend}", "model=tiny_llama", "backend.async_scheduling=true"))


def test_tools_comparing_with_the_engine_drop_the_default_front_end():
    from testbed.app.assembly.frontend import without_frontend

    cfg = without_frontend(config("model=tiny_llama"), "testbed-fidelity")
    assert cfg.frontend.name == "none" and cfg.frontend.request_s == 0


def test_a_head_size_the_nearest_tables_lack_is_read_from_the_next_version():
    """vLLM 0.14.0's H100 attention tables time head_dim 128 only; a 64-wide model (Llama-3.2-1B, a draft
    model) is priced from the next version that has it, and the summary's versions say so."""
    db = KernelDB("h100_sxm", "vllm", near="0.15.1")
    db.attention_grid("generation", 32, 8, 128)
    db.attention_grid("generation", 32, 8, 64)
    assert db.versions["generation_attention"] == "0.14.0"
    assert db.versions["generation_attention (another head size)"] == "0.24.0"
    with pytest.raises(KernelDBError, match="head_dim=80 was not measured.*measured: \\[64, 128"):
        db.attention_grid("context", 32, 8, 80)
