#!/usr/bin/env bash
# Check that dora-ext's slime patches apply to a slime checkout (or are already applied).
#   patches/slime/check.sh /path/to/slime        exit 0: applies or already applied; 1: does not apply
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
slime="${1:?usage: $0 /path/to/slime-checkout}"
base=624b824a898ab0ec1fcb4d373004c7f3852bf515
if [ ! -f "$slime/slime/ray/actor_group.py" ]; then
  echo "$slime: not a slime checkout (no slime/ray/actor_group.py)" >&2
  exit 1
fi
if head=$(git -C "$slime" rev-parse HEAD 2>/dev/null) && [ "$head" != "$base" ]; then
  echo "note: $slime is at $head; the patches were made against $base" >&2
fi
status=0
for p in "$here"/*.patch; do
  name=$(basename "$p")
  if git -C "$slime" apply --check "$p" 2>/dev/null; then
    echo "$name: applies"
  elif git -C "$slime" apply --check --reverse "$p" 2>/dev/null; then
    echo "$name: already applied"
  else
    echo "$name: DOES NOT APPLY" >&2
    git -C "$slime" apply --check "$p" || true
    status=1
  fi
done
exit $status
