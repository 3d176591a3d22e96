"""The Ray executor's signal job (see `ray.py`'s docstring): Ray's job API can stop a job (a
SIGTERM to its whole process tree, then SIGKILL) but not signal its main process alone, so
`terminate` submits a tiny job pinned to the attempt's node that sends the signal itself."""

from __future__ import annotations

import shlex

# Every attempt's process carries its submission id in this variable (the entrypoint sets
# it): what the signal script finds it by.
SUBMISSION_ENV = "VISIONLOOP_RAY_SUBMISSION_ID"

# The signal job's entrypoint (`signal_entrypoint`): `sh -c SCRIPT vl-signal SUBMISSION_ID
# SIGNAL`. It signals the roots of the attempt's process tree (marked processes whose parent
# is not marked): the entrypoint's main process, which Ray's supervisor started. It retries
# for ~10 s, because a job reads RUNNING a moment before its command is exec'd. Only
# processes of its own cluster: Ray's supervisor gives every job's driver the cluster's GCS
# address as RAY_ADDRESS, and two clusters on one machine (two test workers; two installs)
# may both run a job with the same submission id (a CI run saw another cluster's attempt
# SIGTERMed at its start).
SIGNAL_SCRIPT = (
    f'want="{SUBMISSION_ENV}=$1"\n'
    + r"""here="RAY_ADDRESS=${RAY_ADDRESS:-}"
n=0
while :; do
  marked=" "
  for f in $(grep -lsxzF -e "$want" /proc/[0-9]*/environ); do
    if [ -n "${RAY_ADDRESS:-}" ] && ! grep -qsxzF -e "$here" "$f"; then continue; fi
    p=${f#/proc/}; marked="$marked${p%/environ} "
  done
  sent=""
  for p in $marked; do
    pp=$(sed -n 's/^PPid:[[:space:]]*//p' "/proc/$p/status" 2>/dev/null)
    case "$marked" in *" $pp "*) ;; *) kill -s "$2" "$p" 2>/dev/null && sent="$sent $p" ;; esac
  done
  if [ -n "$sent" ]; then echo "visionloop: sent SIG$2 to$sent ($1)"; exit 0; fi
  n=$((n + 1))
  if [ "$n" -ge 40 ]; then echo "visionloop: no process of $1 on this node"; exit 1; fi
  sleep 0.25
done"""
)


def signal_entrypoint(submission_id: str, signal: str) -> str:
    """The signal job's command: send SIG`signal` (TERM, ...) to the attempt `submission_id`'s
    main process on the node the job is pinned to."""
    return f"sh -c {shlex.quote(SIGNAL_SCRIPT)} vl-signal {shlex.quote(submission_id)} {signal}"
