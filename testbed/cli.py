"""Console entry points (`testbed-sim`, `python -m testbed`).

The config directory is given to Hydra as an absolute path found from this file, not as
a path relative to the module: Hydra turns a module-relative path into a `pkg://`
search path when it is called from a console script, and `conf/` lives beside the
package, not inside it. This way the command works from any directory.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from testbed.config import register_configs

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
log = logging.getLogger("testbed")

register_configs()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    from testbed.results import format_table, write_results
    from testbed.run import run, run_info

    result = run(cfg)
    out = write_results(cfg.output.dir, result.requests, result.steps if cfg.output.write_steps else None,
                        result.summary, OmegaConf.to_yaml(cfg, resolve=True), run_info(result))
    if cfg.logger.name == "wandb":
        from testbed.wandb_log import log_to_wandb

        log_to_wandb(cfg, result, out)
    if cfg.output.print_table:
        where = (f"{cfg.hardware.name}, {cfg.cost_model.name}" if cfg.backend.name == "sim"
                 else f"engine on {result.summary.get('device')}")
        title = f"{cfg.policy.name} on {cfg.trace.name} ({cfg.model.name}, {where})"
        overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
        print(f"\n{title}" + (f"  [{' '.join(overrides)}]" if overrides else ""))
        print(format_table(result.summary))
        what = "simulated" if cfg.backend.name == "sim" else "replayed on the engine"
        print(f"results: {out}  ({what} in {result.wall_s:.2f} s wall)")
    if result.summary.get("interrupted"):
        print("interrupted: unfinished requests are marked as such in the results", file=sys.stderr)
        sys.exit(130)
    return result.summary


if __name__ == "__main__":
    main()
