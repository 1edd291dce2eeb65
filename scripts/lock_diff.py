"""What this venv has that requirements.lock does not: the versions `make test-latest` is trying.

    .venv-latest/bin/python scripts/lock_diff.py requirements.lock

Prints one line per distribution whose installed version differs from the lock's (or that only
one side has) and exits 0: it reports, it does not judge. `make lock` then takes the new set.
"""
from __future__ import annotations

import re
import sys
from importlib import metadata

PIN = re.compile(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^\s;\\]+)")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked(path: str) -> dict[str, str]:
    with open(path) as f:
        return {normalize(m[1]): m[2] for m in map(PIN.match, f) if m}


def installed() -> dict[str, str]:
    return {normalize(d.metadata["Name"]): d.version for d in metadata.distributions()}


def main(lock_path: str) -> int:
    lock, here = locked(lock_path), installed()
    here.pop("vllm-anatomy", None)
    rows = [(name, lock.get(name, "-"), here.get(name, "-")) for name in sorted(lock.keys() | here.keys())
            if lock.get(name) != here.get(name)]
    print(f"{len(rows)} distributions differ from {lock_path}" + (":" if rows else ""))
    for name, old, new in rows:
        print(f"  {name:32} {old:>14} -> {new}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "requirements.lock"))
