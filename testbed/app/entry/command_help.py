"""`--help` of the Hydra console scripts: what the command does, how it is called, and the options it offers.

Hydra's own help opens with "<app> is powered by Hydra", lists every config group's options (the
`*_schema` nodes that app/assembly/config.py registers for the config files to name among them, which are no
options: app/assembly/validate.py `schema_choices` refuses them) and dumps the whole config. Every Hydra command
of the testbed composes the same conf/config.yaml, whose `hydra.help.template` is `${testbed_help:}`:
this module's `template`, which knows the command from `stop.command_name()` (set by the console script
before it imports Hydra) and reads the options from the conf/ folder itself.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from testbed.app.entry.stop import command_name

DEFAULT = "testbed-sim"
# command -> (what it does, usage lines); each command's module docstring holds the details
COMMANDS: dict[str, tuple[str, list[str]]] = {
    "testbed-sim": (
        "Replay a request trace through a scheduling policy and print its SLO table (TTFT, TPOT, ITL, E2E,\n"
        "goodput, attainment); results in outputs/<date>/<time>_<policy>_<trace>/. The simulator by default\n"
        "(the validated configuration: Llama-3.1-8B on an H100, vLLM's scheduler); backend=engine runs the\n"
        "testbed's torch engine, backend=vllm real vLLM.",
        ["testbed-sim experiment=quick                       # a few hundred requests, seconds",
         "testbed-sim policy=sarathi trace.rate_scale=2",
         "testbed-sim backend=engine model=tiny_llama experiment=quick   # the real engine, on a CPU too",
         "testbed-sim -m policy=vllm,sarathi,fastserve trace.rate_scale=1,2,4   # a sweep"]),
    "testbed-capacity": (
        "Find the highest load (trace.rate_scale) at which slo.attainment_target of the requests meet the\n"
        "SLO, by bisection over simulations; writes capacity.json.",
        ["testbed-capacity policy=vllm trace.end_s=600",
         "testbed-capacity -m experiment=max_rate"]),
    "testbed-disagg-search": (
        "Split disagg.search_total_replicas replicas into prefill and decode pools every way, find each\n"
        "layout's highest load meeting the SLO, and name the best (DistServe's placement search).",
        ["testbed-disagg-search model=llama3_1_70b parallel.tensor_parallel_size=4 disagg.search_total_replicas=4"]),
    "testbed-profile": (
        "Profile the engine over a grid of batch shapes and write the step times a cost_model=profile reads.",
        ["testbed-profile model=tiny_llama backend.device=cpu profile.grid=quick profile.out=my_profile.csv"]),
    "testbed-fidelity": (
        "Replay one trace on the real engine and in the simulator calibrated from it, and compare them\n"
        "request by request.",
        ["testbed-fidelity model=tiny_llama backend.device=cpu trace.max_requests=100 trace.rate_scale=20"]),
    "testbed-referee": (
        "Check the testbed's vllm policy against real vLLM's scheduler, decision by decision, on a trace\n"
        "(needs vLLM installed).",
        ["testbed-referee model=tiny_llama model.head_dim=32 trace.max_requests=500 kv.num_blocks=64"]),
    "testbed-validate": (
        "Replay real serving runs in the simulator and score its error per run, stage and metric.",
        ["testbed-validate validate.runs=path/to/runs cost_model=kernels frontend=vllm_api"]),
    "testbed-traces": (
        "Describe a trace as a run would replay it: rows, rate and burstiness, lengths, prefix reuse,\n"
        "sessions, with plots.",
        ["testbed-traces describe trace=azure_conv",
         "testbed-traces describe trace=mooncake trace.max_requests=1000"]),
}


def config_groups(conf_dir: Path | None = None) -> list[tuple[str, list[str]]]:
    """Each config group of conf/ (experiment's sub-folders included, Hydra's own left out) and its options."""
    conf = conf_dir or Path(str(resources.files("testbed") / "conf"))
    groups = []
    for folder in sorted(p for p in conf.rglob("*") if p.is_dir() and "hydra" not in p.relative_to(conf).parts):
        options = sorted(f.stem for f in folder.glob("*.yaml"))
        if options:
            groups.append((folder.relative_to(conf).as_posix(), options))
    return groups


def template() -> str:
    """Hydra's help template for the running command (a string.Template: a literal `$` doubled)."""
    name = command_name() or DEFAULT
    what, usage = COMMANDS.get(name, COMMANDS[DEFAULT])
    groups = "\n".join(f"  {group}: {', '.join(options)}" for group, options in config_groups())
    text = (f"{name}: {what}\n\nUsage:\n" + "\n".join(f"  {line}" for line in usage) + "\n\n"
            "Config groups (group=option):\n" + groups + "\n\n"
            "Any key of the config can be set as key=value (e.g. trace.max_requests=300). Flags: -m (--multirun)\n"
            "sweeps comma-separated values, --cfg job prints the whole config, --info where each part came\n"
            "from, --hydra-help Hydra's own flags.")
    return text.replace("$", "$$")
