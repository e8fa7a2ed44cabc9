"""Process groups and collectives for tensor, sequence and CFG parallelism."""
