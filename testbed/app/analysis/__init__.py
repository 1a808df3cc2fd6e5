"""What a run's numbers mean: metrics and result files, capacity and disaggregation searches, and the commands that check the simulator against real runs (fidelity, referee, validate)."""
