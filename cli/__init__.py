"""The `streamserve` command: its parser (main.py), the one-machine launcher (`up`), one
stage replica (`stage`), and the load generator (`bench`) with its workloads."""

from cli.main import main

__all__ = ["main"]
