#!/usr/bin/env bash
# Refresh the locked dependency sets from today's registries, then prove them: a fresh venv installs from the new
# locks (scripts/install.sh test) and runs the whole suite (scripts/test.sh; extra arguments go to pytest). On
# success the new locks stay in locks/ for you to review (`git diff --stat locks/`) and commit; if the install or
# the suite fails, the previous locks are put back and the new ones are kept aside for a look.
#   bash scripts/lock.sh
# When: after changing a dependency in pyproject.toml (tests/unit/test_locks.py fails until the locks cover it),
# and on purpose now and then to take new releases, never as a side effect of an ordinary install.
set -euo pipefail
cd "$(dirname "$0")/.."
keep=$(mktemp -d)
cp locks/*.txt "$keep/"
python scripts/locks.py
venv="$keep/venv"
python -m venv "$venv"
if ( . "$venv/bin/activate" && bash scripts/install.sh test && bash scripts/test.sh "$@" ); then
  rm -rf "$venv"
  echo "lock.sh: the suite passed on the refreshed locks; review 'git diff --stat locks/' and commit them"
else
  mkdir -p "$keep/new"
  for file in cpu.txt cpu-test.txt gpu.txt; do
    cp "locks/$file" "$keep/new/$file"
    cp "$keep/$file" "locks/$file"
  done
  echo "lock.sh: the refreshed locks failed; the previous ones are back in locks/, the new ones are in $keep/new" >&2
  exit 1
fi
