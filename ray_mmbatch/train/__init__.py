"""Training: the step math (step.py, no Ray), the per-worker loop (loop.py), the driver (trainer.py),
the ranks' records to the driver (events.py), checkpoints, FSDP, the stall guard, and ingest.py:
the project's batches inside a user's own Ray Train loop."""
