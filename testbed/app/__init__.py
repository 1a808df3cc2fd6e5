"""The application around the core and its backends, in rooms, so that the path from a config to
results reads in one place (`assembly/`) and the CLI and the Python API are two doors to it:

- `entry/`: the command line's door (console scripts, `python -m testbed`, Hydra composition, signals);
  the Python API's door is `testbed/api.py`
- `assembly/`: from a config to a run (schemas and their check, policies, the run of every backend)
- `analysis/`: metrics and result files, capacity and disaggregation searches, checks against real runs
- `reports/`: a sweep's table, its HTML report, W&B
- `profiling/`: a real backend's step times measured for a cost model

Nothing imports it but its own entry points."""
