"""The `streamserve` command. No torch; it starts a worker by module name.

main.py            the parser and every subcommand's entry
launcher.py        `up`: the embedded server and every stage on one machine, restarted when
                   they die, stopped in order
worker_command.py  the command lines that start a worker and the GPU check
run_stage.py       `stage`: one CPU stage replica
bench.py           `bench`: the load generator; workloads.py its workloads
status.py          `status`: the deployment's live picture in the terminal
batch.py           `batch`: submit, status, results, cancel, list; batch_sources.py reaches
                   the batches through Redis or an ingress's HTTP API
weights.py         `weights`: new weights for every worker (update), and where they are
__main__.py        `python -m cli`
"""

from cli.main import main

__all__ = ["main"]
