"""The CLI's own start-up, against the Python client doing the same thing (issue 25, item 10).

    python bench/cli_startup.py

Times, a process each (median of 10 after 2 warm-up runs): `ckptctl status --json` against a
control socket that does not exist (the command starts, finds no job, exits 1), `python -c` with
`ckptctl.client.status` doing the same, and a bare `python -c pass`. The gap between the first
two is what the CLI costs a push on top of `ckptctl.client.push`. Writes cli-startup.{json,md}
to bench/results/ (or --out), replacing the previous run's, with the commit, date and machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

NO_JOB = "/tmp/ckptctl-bench-no-such-job.sock"
CLIENT = (
    "from ckptctl import client\n"
    "try:\n"
    f"    client.status(control_socket={NO_JOB!r})\n"
    "except Exception:\n"
    "    pass\n"
)


def median_seconds(cmd: list[str], runs: int = 12, warm_up: int = 2) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warm_up:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="default: bench/results/")
    args = parser.parse_args()
    from result_files import RESULTS, write_results

    cli = median_seconds(["ckptctl", "status", "--control-socket", NO_JOB, "--json"])
    client = median_seconds([sys.executable, "-c", CLIENT])
    bare = median_seconds([sys.executable, "-c", "pass"])
    doc = {
        "cli_s": cli,
        "client_s": client,
        "bare_python_s": bare,
        "cli_minus_client_s": cli - client,
    }
    md = (
        "# The CLI's start-up against the Python client\n\n    python bench/cli_startup.py\n\n"
        "| `ckptctl status` | python + `ckptctl.client.status` | bare python | CLI minus client |\n"
        "| --- | --- | --- | --- |\n"
        f"| {cli:.3f} s | {client:.3f} s | {bare:.3f} s | {cli - client:.3f} s |\n\n"
        "Medians of 10 (after 2 warm-up runs), a process each, against a control socket that "
        "does not exist.\n"
    )
    write_results(args.out or RESULTS, "cli-startup", doc, md)


if __name__ == "__main__":
    main()
