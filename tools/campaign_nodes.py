"""The nodes the next job of a campaign must avoid, from the run's failure records (stdlib only; called by
examples/frontier/campaign.sh before a job exits). One line per host: ``host<TAB>why``; nothing when none.

    python tools/campaign_nodes.py runs/gpt22b/checkpoints/failures.jsonl
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megatron.resilience.failure_record import hosts_to_exclude, read_records  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: campaign_nodes.py RUN_SAVE_DIR/failures.jsonl", file=sys.stderr)
        return 2
    for host, why in sorted(hosts_to_exclude(read_records(argv[0])).items()):
        print(f"{host}\t{why}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
