"""OpenAI's Batch API at the ingress.

routes.py  /v1/files and /v1/batches over the stores in batch_store/
runner.py  every replica runs batches: leases, lines at priority 1, exactly-once results
"""
