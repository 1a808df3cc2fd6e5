"""The application around the core and its backends: Hydra entry points and config schemas,
the one path from a config to results, metrics and result files, reports, sweeps, W&B,
capacity search, profiling and fidelity commands. Nothing imports it but its own entry points."""
