"""What a new AWS session and its clients cost the eks target's tasks and triggers (they make one
at each call or poll): through the process's one botocore loader (`aws_session`), and with a
loader of the session's own, botocore's default.

    PYTHONPATH=plugins:. AIRFLOW_HOME=.airflow .venv/bin/python -m bench.aws_clients [--rounds N]

Prints the median milliseconds of a session plus the clients named (no request is sent).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--clients", default="s3,eks", help="comma-separated service names")
    args = parser.parse_args(argv)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    import botocore.loaders

    from finetune.targets.eks.clients import aws_session

    services = args.clients.split(",")

    def shared():
        return aws_session("")

    def own():
        session = aws_session("")
        session._session.register_component("data_loader", botocore.loaders.create_loader())
        return session

    for label, make in (("one loader a process (aws_session)", shared),
                        ("a loader a session (botocore's default)", own)):
        times = []
        for _ in range(args.rounds + 1):
            start = time.perf_counter()
            session = make()
            for service in services:
                session.client(service)
            times.append(time.perf_counter() - start)
        print(f"{label}: {statistics.median(times[1:]) * 1e3:.1f} ms a session and "
              f"{'+'.join(services)} clients (median of {args.rounds})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
