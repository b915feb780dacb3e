#!/usr/bin/env python3
"""Sums a worker profile of scripts/perf-worker.sh into CPU per message by part of the path.

Usage: scripts/perf-groups.py PERF_DATA MESSAGES [FREQUENCY]

Reads `perf script` of PERF_DATA (recorded at FREQUENCY Hz, default 1999, while the worker took
MESSAGES messages) and puts each sample in the first part below whose pattern a frame of its
stack matches: the pipeline's parts first (a sample of an ack sent by the settle step is the
settle step's), then the broker's client library, then the metrics endpoint; the rest is the
runtime (tokio's I/O driver and scheduler) and what matched nothing. Prints the transport the
profile is of, and per part: samples, share and µs of CPU per message.
"""

import collections
import re
import subprocess
import sys

PARTS = [
    ("receive: the broker's message made a Message", [r">::convert\b", r"Identity::message"]),
    ("receive: Kafka keys, delivery marks, revocations",
     [r"Kafka>::(set_keys|raise_marks|put_identified_first|drop_revoked|count_deliveries)"]),
    ("intake: payload and headers JSON, ids", [r"Pipeline<T>>::new_event"]),
    ("store: the batch statement (sqlx)", [r"StoreContext::store_events"]),
    ("settle: acks or commits, the batch dropped", [r"Pipeline<T>>::settle\b"]),
    ("the broker's client library", [r"async_nats::", r"rdkafka::", r"rd_kafka", r"lapin::",
                                      r"redis::", r"aws_sdk", r"aws_smithy", r"hyper_util::client"]),
    ("the metrics endpoint (scraped by the bench)", [r"axum::", r"hyper::server"]),
]


def stacks(path):
    """The stacks of `perf script`, each a list of symbols, innermost first."""
    text = subprocess.run(["perf", "script", "-i", path], capture_output=True, text=True,
                          errors="replace", check=True).stdout
    for block in text.split("\n\n"):
        lines = block.splitlines()
        frames = [line.strip().split(None, 1) for line in lines[1:]]
        yield [f[1].rsplit(" (", 1)[0] for f in frames if len(f) == 2]


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    path, messages = sys.argv[1], int(sys.argv[2])
    frequency = int(sys.argv[3]) if len(sys.argv) == 4 else 1999
    patterns = [(label, re.compile("|".join(p))) for label, p in PARTS]
    counts = collections.Counter()
    transports = collections.Counter()
    total = 0
    for stack in stacks(path):
        if not stack:
            continue
        total += 1
        joined = "\n".join(stack)
        transports.update(set(re.findall(r"switchboard_worker::transport::(\w+)::", joined)))
        label = next((label for label, pattern in patterns if pattern.search(joined)),
                     "runtime and the rest")
        counts[label] += 1
    if not total:
        sys.exit(f"{path}: no samples")
    kind = transports.most_common(1)[0][0] if transports else "?"
    print(f"{path}: transport {kind}, {total} samples, "
          f"{total / frequency / messages * 1e6:.2f} µs of CPU per message")
    for label in [label for label, _ in PARTS] + ["runtime and the rest"]:
        n = counts[label]
        print(f"  {n:6d}  {100 * n / total:5.1f}%  {n / frequency / messages * 1e6:5.2f} µs/msg  {label}")


if __name__ == "__main__":
    main()
