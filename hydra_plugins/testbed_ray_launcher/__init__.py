"""The testbed's Hydra launcher on Ray 2.x (`hydra/launcher=ray`, `hydra/launcher=ray_cluster`).

Hydra's own hydra-ray-launcher 1.2 pins `cloudpickle<3` (below what is installed beside it here) and pulls
`ray[default]`, boto3 and the AWS autoscaler; a sweep needs none of that, only one Ray task per job.
It lives in Hydra's `hydra_plugins` namespace package, the only place Hydra accepts a plugin from
(hydra/core/plugins.py, `Plugins._instantiate`: `is_in_toplevel_plugins_module`).
"""
