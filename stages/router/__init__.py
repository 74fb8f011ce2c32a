"""The router stage: it routes each tokenized job to a live worker (stage.py), by the prefix
its cache holds against its load (kv_routing.py, over the index of the workers' cached blocks
in kv_index.py; its figures in router_metrics.py), and moves a dead worker's jobs back to be
routed again (worker_reaper.py)."""
