"""`testbed-vllm-bench`: replay a real `vllm bench serve` run in the simulator and print real against simulated.

Why: a lab that ran `vllm bench serve --save-result --save-detailed` on its own GPU can check the simulator
on that GPU in one step. The result file holds the run's traffic arguments (num_prompts, request_rate,
burstiness); the dataset's are given as vLLM was given them. The requests are rebuilt as vLLM built them
(`testbed.traces.vllm_bench`): for `--dataset-name random` the lengths from the seed, for a dataset read from
a file (sharegpt, ...) the per-request `input_lens`/`output_lens` the file saved; the send times from the
request rate, burstiness and seed. Then the run is simulated, written as a run is (summary.json, ...,
vllm_bench.json in vLLM's keys) and compared per metric.

Usage:
    testbed-vllm-bench RESULT.json --seed 42 --random-input-len 256 --random-output-len 64 \\
        --random-range-ratio 0.25 [hardware=h100 scheduler.max_num_seqs=256 ...]
Hydra overrides set the model, hardware and server settings as for testbed-sim; without `model=...` the
model config whose hf_id is the file's model_id is taken. Bad input: one line naming the key, exit 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import datetime
from pathlib import Path

from testbed.app.vllm_bench_format import METRICS, BenchResultError, bench_result, read_result, result_json
from testbed.traces.vllm_bench import bench_requests, random_lengths, send_times

NAME = "testbed-vllm-bench"
FILE_DATASETS = ("sharegpt", "custom", "hf", "burstgpt", "sonnet", "spec_bench", "prefix_repetition")
# what is compared: vLLM's throughputs and its headline statistics of each latency
ROWS = (("duration", "duration (s)"), ("completed", "completed"),
        ("request_throughput", "request throughput (req/s)"),
        ("output_throughput", "output throughput (tok/s)"),
        ("total_token_throughput", "total token throughput (tok/s)"),
        *((f"{s}_{m}_ms", f"{s} {m.upper()} (ms)") for m in METRICS for s in ("mean", "median", "p99")),
        ("max_output_tokens_per_s", "peak output tokens/s"), ("max_concurrent_requests", "peak concurrent requests"))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=NAME, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", help="a `vllm bench serve --save-result` JSON file (with --save-detailed for "
                                   "datasets read from files)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for testbed-sim (model=..., hardware=...)")
    ap.add_argument("--dataset-name", default="random", help="as given to vllm bench serve (its default: random)")
    ap.add_argument("--seed", type=int, default=0, help="as given to vllm bench serve (its default: 0)")
    ap.add_argument("--num-prompts", type=int, help="checked against the file's")
    ap.add_argument("--request-rate", type=float, help="checked against the file's")
    ap.add_argument("--burstiness", type=float, help="checked against the file's")
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.0)
    ap.add_argument("--random-prefix-len", type=int, default=0)
    ap.add_argument("--num-special-tokens", type=int, default=1,
                    help="tokens the tokenizer adds to a prompt (Llama-3: 1, its BOS), as vLLM subtracts them")
    ap.add_argument("--lengths", choices=("auto", "seed", "file"), default="auto",
                    help="auto: the seed's for random, the file's otherwise")
    ap.add_argument("--out", help="results folder (default outputs/<date>/<time>_vllm_bench_<file stem>)")
    return ap


def workload(real: dict, args) -> tuple[list, list[str]]:
    """The run's requests and notes on where their lengths and times came from."""
    n = real["num_prompts"]
    for flag, key in (("num_prompts", "num_prompts"), ("request_rate", "request_rate"), ("burstiness", "burstiness")):
        given = getattr(args, flag)
        if given is not None and float(given) != float(real[key]):
            raise BenchResultError(f"--{flag.replace('_', '-')}={given}: the result file says {key}={real[key]}")
    if real.get("max_concurrency") is not None:
        raise BenchResultError(f"{args.result}: key 'max_concurrency' is {real['max_concurrency']}: the replay is "
                               "open-loop; replay a run made without --max-concurrency")
    if real.get("ramp_up_strategy") is not None:
        raise BenchResultError(f"{args.result}: key 'ramp_up_strategy' is {real['ramp_up_strategy']!r}: a ramp-up "
                               "is not replayed; replay a run at a fixed --request-rate")
    notes = []
    source = args.lengths if args.lengths != "auto" else ("seed" if args.dataset_name == "random" else "file")
    if source == "seed":
        if args.dataset_name != "random":
            raise BenchResultError("--lengths seed: only --dataset-name random draws its lengths from the seed")
        prompts, outputs = random_lengths(n, args.random_input_len, args.random_output_len, args.random_range_ratio,
                                          args.seed, args.random_prefix_len, args.num_special_tokens)
        notes.append(f"lengths: drawn from seed {args.seed} as vLLM's random dataset draws them")
        if "input_lens" in real:
            same = sum(a == b for a, b in zip(prompts, real["input_lens"]))
            same_out = sum(a == b for a, b in zip(outputs, real["output_lens"]) if b)
            notes.append(f"  the file's input_lens agree for {same}/{n} requests, output_lens for {same_out}/"
                         f"{sum(1 for b in real['output_lens'] if b)} completed"
                         + ("" if same == n else " (check the --random-* arguments and --num-special-tokens, "
                                                 "or take the file's: --lengths file)"))
    else:
        for key in ("input_lens", "output_lens"):
            if key not in real:
                raise BenchResultError(f"{args.result}: key {key!r} is missing: --dataset-name {args.dataset_name} "
                                       "reads its lengths from the file; rerun vllm bench serve with --save-detailed")
        prompts = real["input_lens"]
        # a failed request saved output length 0: what it would have generated is unknown, its expected one is gone
        outputs = [o if o > 0 else max(1, round(real["total_output_tokens"] / max(real["completed"], 1)))
                   for o in real["output_lens"]]
        failed = sum(1 for o in real["output_lens"] if o == 0)
        notes.append("lengths: the file's input_lens and output_lens" + (
            f" ({failed} failed requests given the completed ones' mean output)" if failed else ""))
    rate = float(real["request_rate"]) if real["request_rate"] != "inf" else math.inf
    times = send_times(n, rate, float(real["burstiness"]), args.seed)
    notes.append(f"send times: request_rate {real['request_rate']}, burstiness {real['burstiness']}, seed {args.seed} "
                 "as vLLM's get_request draws them")
    if "start_times" in real and n > 1:
        t0 = real["start_times"][0]
        off = max(abs((s - t0) - (t - times[0])) for s, t in zip(real["start_times"], times))
        notes.append(f"  the file's start_times agree within {off * 1e3:.2f} ms")
    return bench_requests(prompts, outputs, times), notes


def _run_dir(args) -> str | None:
    """`hydra.run.dir=DIR` among the overrides (as testbed-sim takes it): the results folder, taken out."""
    for o in list(args.overrides):
        if o.startswith("hydra."):
            key, _, value = o.partition("=")
            if key != "hydra.run.dir":
                raise BenchResultError(f"{o}: only hydra.run.dir is taken here (the results folder, as --out)")
            args.overrides.remove(o)
            return value
    return None


def compose(overrides: list[str], model_id: str, out: Path):
    from hydra import compose as hydra_compose, initialize_config_dir

    from testbed.app.cli import CONF_DIR  # registers the config schemas
    from testbed.app.validate import check_config

    if not any(o.split("=", 1)[0].lstrip("+~") == "model" for o in overrides):
        model = model_for(model_id, CONF_DIR)
        overrides = [f"model={model}", *overrides]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("config", overrides=[*overrides, "output.record_token_times=true",
                                                 "output.progress=false", f"output.dir={out}"])
    check_config(cfg)
    return cfg


def model_for(model_id: str, conf_dir: Path) -> str:
    """The model config whose hf_id is `model_id` (a served name may differ in case)."""
    import yaml

    for path in sorted((conf_dir / "model").glob("*.yaml")):
        hf_id = (yaml.safe_load(path.read_text()) or {}).get("hf_id")
        if hf_id and hf_id.lower() == model_id.lower():
            return path.stem
    raise BenchResultError(f"model_id {model_id!r}: no model config has this hf_id; pass model=<name> "
                           "(testbed/conf/model) or model.config_json=<its config.json>")


def _real_e2el(real: dict) -> None:
    """E2E statistics from `latencies` where vLLM's default --percentile-metrics (ttft,tpot,itl) left them out."""
    import numpy as np

    if "mean_e2el_ms" in real or "latencies" not in real:
        return
    errors = real.get("errors") or [""] * len(real["latencies"])
    lat = np.array([x for x, e in zip(real["latencies"], errors) if not e and x > 0]) * 1e3
    if lat.size:
        real.update(mean_e2el_ms=float(lat.mean()), median_e2el_ms=float(np.median(lat)),
                    p99_e2el_ms=float(np.percentile(lat, 99)))


def comparison(real: dict, sim: dict) -> list[dict]:
    rows = []
    for key, label in ROWS:
        r, s = real.get(key), sim.get(key)
        err = (s - r) / r if isinstance(r, (int, float)) and isinstance(s, (int, float)) and r else None
        rows.append({"metric": key, "label": label, "real": r, "sim": s, "rel_error": err})
    return rows


def format_comparison(rows: list[dict]) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = [f"{'metric':<32}{'real':>12}{'simulated':>12}{'rel. error':>12}"]
    for r in rows:
        err = "-" if r["rel_error"] is None else f"{r['rel_error']:+.1%}"
        lines.append(f"{r['label']:<32}{fmt(r['real']):>12}{fmt(r['sim']):>12}{err:>12}")
    return "\n".join(lines)


def replay(args) -> int:
    from omegaconf import OmegaConf

    from testbed.app.results import write_results
    from testbed.app.run import run_info, simulate
    from testbed.app.stop import stop_on_signals

    real = read_result(args.result)
    requests, notes = workload(real, args)
    out = Path(args.out or _run_dir(args) or f"outputs/{datetime.now():%Y-%m-%d/%H-%M-%S}_vllm_bench_"
                                              f"{Path(args.result).stem}")
    cfg = compose(args.overrides, real["model_id"], out)
    with stop_on_signals() as stop:
        result = simulate(cfg, stop, requests=requests)
    result.summary["trace"] = f"vllm-bench:{Path(args.result).name}"  # the requests were the file's, not cfg.trace's
    write_results(out, result.requests, result.steps, result.summary, OmegaConf.to_yaml(cfg, resolve=True),
                  run_info(result))
    sim = bench_result(result.requests, result.summary, real["model_id"], backend=real.get("backend", "openai"),
                       request_rate=real["request_rate"], burstiness=real["burstiness"], start_s=0.0,
                       label=f"testbed-sim replay of {Path(args.result).name}")
    (out / "vllm_bench.json").write_text(result_json(sim))
    _real_e2el(real)
    rows = comparison(real, sim)
    title = (f"{real['model_id']}: {real['num_prompts']} prompts at {real['request_rate']} req/s (burstiness "
             f"{real['burstiness']}), real `vllm bench serve` ({Path(args.result).name}) against the simulator "
             f"({result.summary.get('hardware')}, {result.summary.get('cost_model')}, {cfg.policy.name})")
    text = "\n".join([title, *notes, "", format_comparison(rows)]) + "\n"
    (out / "comparison.txt").write_text(text)
    (out / "comparison.json").write_text(json.dumps({"result": str(args.result), "notes": notes, "rows": rows},
                                                    indent=2) + "\n")
    print(text + f"results: {out}")
    if result.summary.get("interrupted"):
        from testbed.app.stop import exit_code

        return exit_code(stop.signum)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    try:
        return replay(args)
    except (BenchResultError, ValueError) as e:  # a bad file, argument or config: one line, no traceback
        print(f"{NAME}: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    except Exception as e:  # Hydra's own errors on a bad override
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if isinstance(e, (HydraException, OmegaConfBaseException)):
            print(f"{NAME}: {str(e).splitlines()[0]}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
