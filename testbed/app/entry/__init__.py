"""The doors: console scripts and `python -m testbed`, Hydra composition, and stopping a command or a sweep cleanly on a signal."""
