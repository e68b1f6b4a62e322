"""`python -m experiments.runner.chain JSON`: the argv lists in JSON, one after another, each
once the one before exited 0; exits with the first non-zero code (a signal's: 128 + its
number). A run's `then` commands go through it, so they share its attempt and its LOCK.

SIGTERM and SIGINT reach the running command directly (the grid signals the whole process
group); here they only stop the commands after it from starting."""

import json
import signal
import subprocess
import sys


def main(argv: list[str]) -> int:
  commands = json.loads(argv[0])
  stopped = []
  for signum in (signal.SIGTERM, signal.SIGINT):
    # A handler, not SIG_IGN: an ignored signal would stay ignored in the commands started.
    signal.signal(signum, lambda signum, frame: stopped.append(signum))
  for command in commands:
    if stopped:
      return 128 + stopped[0]
    code = subprocess.call(command)
    if code != 0:
      return code if code > 0 else 128 - code
  return 128 + stopped[0] if stopped else 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
