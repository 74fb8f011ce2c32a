"""CPU time of a process tree, summed by what each process is (a stage, a worker, this
process), from Linux' /proc: utime + stime of every thread of each process."""

from __future__ import annotations

import os
from collections import defaultdict

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")

# A command line's marker -> the kind of process it is (`streamserve up`'s children).
KINDS = (
    ("gpu_worker", "worker"),
    ("stage ingress", "ingress"),
    ("stage tokenizer", "tokenizer"),
    ("stage router", "router"),
    ("stage detokenizer", "detokenizer"),
    ("cli up", "launcher"),
)


def _read(pid: int) -> tuple[int, float, str] | None:
    """(parent pid, CPU seconds so far, command line) of `pid`; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    # After the name: state, ppid, ... utime is field 14 of stat, stime 15 (1-based).
    return int(fields[1]), (int(fields[11]) + int(fields[12])) * TICK_S, command


def kind_of(command: str) -> str | None:
    return next((kind for marker, kind in KINDS if marker in command), None)


def tree_cpu_by_kind(root: int) -> dict[str, float]:
    """CPU seconds so far of `root` and its descendants with a known kind, summed by kind."""
    procs = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (read := _read(int(entry))) is not None:
            procs[int(entry)] = read
    children = defaultdict(list)
    for pid, (parent, _, _) in procs.items():
        children[parent].append(pid)
    totals: dict[str, float] = defaultdict(float)
    stack = [root]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        if pid in procs and (kind := kind_of(procs[pid][2])) is not None:
            totals[kind] += procs[pid][1]
    return dict(totals)


def process_cpu(pid: int) -> float:
    """CPU seconds so far of process `pid`, every thread (0 once it is gone)."""
    read = _read(pid)
    return 0.0 if read is None else read[1]


def self_cpu() -> float:
    """CPU seconds so far of this process, every thread."""
    times = os.times()
    return times.user + times.system


def find_child(needle: str) -> int | None:
    """The pid of a child of this process whose command line contains `needle`."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (read := _read(int(entry))) is not None:
            if read[0] == me and needle in read[2]:
                return int(entry)
    return None
