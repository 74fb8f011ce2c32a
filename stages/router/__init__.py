"""The router stage: it routes each tokenized job to a live worker (stage.py), and moves a dead
worker's jobs back to be routed again (worker_reaper.py)."""
