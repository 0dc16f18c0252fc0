#!/usr/bin/env bash
# The lineage example end to end, in a temporary copy of this directory (docs/LINEAGE.md):
# a recorded run, a child forked at an event and resumed, a replay served from the record,
# a replay with another model that diverges, and the same recorded live. Scripted models:
# no key, no network. FORKFLEET names the binary (default: forkfleet on the PATH).
set -euo pipefail
ff=${FORKFLEET:-forkfleet}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
cp -r "$here/run.toml" "$here/fast.toml" "$here/careful.toml" "$here/workspace" "$work/"
cd "$work"
echo "== working in $work"

step() { echo; echo "== $*"; }
# The id of the run labelled $1 (`runs ls`: the run id first, the label third).
run_id() { "$ff" runs ls | awk -v l="$1" '$3 == l { print $1 }'; }

step "the parent: a single agent, recorded"
"$ff" run run.toml
main=$(run_id main)
"$ff" log "$main"

step "fork it at seq 6 (the notes read, nothing written yet), with a summary"
"$ff" runs fork "$main" --at-event 6 --label retry --summarize
retry=$(run_id retry)
"$ff" runs show "$retry"
"$ff" runs resume "$retry" "Write the checklist, but keep the old changelog."

step "replay the whole run from its record: no model call, nothing spent"
"$ff" runs fork "$main" --replay --label again

step "replay with another model: the first request differs"
if "$ff" runs fork "$main" --replay --set model=scripted:careful --label careful; then
  echo "unexpected: the replay did not diverge" >&2
  exit 1
fi
"$ff" runs show "$(run_id careful)" | grep '^state'

step "the same, recorded live from the divergence"
"$ff" runs fork "$main" --replay --record --set model=scripted:careful --label careful-live

step "the session tree"
"$ff" runs tree
