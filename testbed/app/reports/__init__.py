"""What a sweep becomes for a reader: its table, its HTML report, its W&B runs."""
