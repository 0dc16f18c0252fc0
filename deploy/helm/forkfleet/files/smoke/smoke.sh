#!/bin/sh
# forkfleet's `helm test` (and tests/suite/helm_smoke.rs, against a real cluster): a
# one-branch scripted fork, created on the installed cluster (the coordinator dispatches
# it, a worker runs it), watched to its end, and checked: the branch is done and its diff
# holds the file it wrote. The cluster comes from $FORKFLEET_CONFIG; exit 0 when it works.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/ws"
echo "forkfleet smoke test" > "$work/ws/README.md"
cp "$here/fork.toml" "$here/script.toml" "$work/"
cd "$work"
id=$(forkfleet fork create fork.toml)
echo "smoke: fork $id created"
forkfleet fork watch "$id" --timeout-s "${SMOKE_TIMEOUT_S:-180}"
state=$(forkfleet fork show "$id" --json | tr -d ' \n' | grep -o '"label":"smoke"[^}]*"state":"[a-z_]*"' | grep -o '"state":"[a-z_]*"' || true)
if [ "$state" != '"state":"done"' ]; then
  echo "smoke: the branch did not finish: ${state:-no state}" >&2
  forkfleet fork show "$id" >&2 || true
  exit 1
fi
if ! forkfleet fork diff "$id" | grep -q "smoke.txt"; then
  echo "smoke: the branch's diff does not show smoke.txt" >&2
  exit 1
fi
echo "smoke: fork $id done, smoke.txt written by a worker"
