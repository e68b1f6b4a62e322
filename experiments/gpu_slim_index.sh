#!/bin/bash
# A device call of this workplace sends the tracked files with the paths it carries, 64 MiB in
# all; with MiniLM's weights (.gpu_minilm, 44 MiB) the committed results of the experiments the
# call does not run can tip it over. This leaves those files out of the index for the call (they
# stay on disk, ignored meanwhile) and puts them back after; nothing is committed in between.
#
#   bash experiments/gpu_slim_index.sh slim [PATH...]  # default: experiments/heads experiments/bottleneck
#   ... the device call ...
#   bash experiments/gpu_slim_index.sh restore
#
# Only non-Python files under PATH leave the index (the code travels). `slim` refuses while the
# index has staged changes or a slim is in force; `restore` puts back exactly what it took.
set -eu
cd "$(dirname "$0")/.."
state=.git/gpu_slim # the paths taken out and the exclude file as it was
case "${1:-}" in
  slim)
    shift
    [ ! -e "$state" ] || { echo "a slim is in force: restore first" >&2; exit 1; }
    git diff --cached --quiet || { echo "the index has staged changes: commit or unstage them" >&2; exit 1; }
    [ $# -gt 0 ] || set -- experiments/heads experiments/bottleneck
    mkdir -p "$state"
    if [ -f .git/info/exclude ]; then cp .git/info/exclude "$state/exclude"; fi
    git ls-files -- "$@" | { grep -v '\.py$' || true; } >"$state/paths"
    if [ ! -s "$state/paths" ]; then
      rm -rf "$state"
      echo "no tracked non-Python file under $*" >&2
      exit 1
    fi
    mkdir -p .git/info
    sed 's|^|/|' "$state/paths" >>.git/info/exclude
    git rm -q --cached --pathspec-from-file="$state/paths"
    ;;
  restore)
    [ -e "$state" ] || { echo "no slim in force" >&2; exit 1; }
    git reset -q --pathspec-from-file="$state/paths"
    if [ -f "$state/exclude" ]; then cp "$state/exclude" .git/info/exclude; else rm -f .git/info/exclude; fi
    rm -rf "$state"
    ;;
  *)
    echo "usage: gpu_slim_index.sh slim [PATH...] | restore" >&2
    exit 2
    ;;
esac
git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {printf "tracked: %.1f MiB\n", s / 1048576}'
