"""Training: OPD objectives as pure tensor functions, pipelines (sync now, async later), checkpoints."""
