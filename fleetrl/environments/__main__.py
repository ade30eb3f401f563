"""Write an environment's rows for `[run] dataset`: one JSON line per task.

    python -m fleetrl.environments rows verifiers:reverse_text examples/verifiers_reverse/rows.jsonl [--path DIR]

`--path DIR` (repeatable) puts DIR on the import path first, for an environment kept beside a run config.
"""

from __future__ import annotations

import argparse
import json
import sys

from fleetrl.environments import environment_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetrl.environments", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rows = sub.add_parser("rows", help="write one row per task of ENVIRONMENT to OUT")
    rows.add_argument("environment", help="verifiers:<taskset id> or openenv:<module:attr>")
    rows.add_argument("out", help="the JSONL file to write")
    rows.add_argument("--path", action="append", default=[], help="a folder to import the environment from")
    rows.add_argument("--options", default="{}", help="the environment's options, as a JSON object")
    args = parser.parse_args(argv)
    sys.path[:0] = args.path
    try:
        found = environment_rows(args.environment, json.loads(args.options))
    except ValueError as exc:
        print(f"fleetrl.environments: {exc}", file=sys.stderr)
        return 2
    finally:
        for path in args.path:
            sys.path.remove(path)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in found)
    print(f"wrote {len(found)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
