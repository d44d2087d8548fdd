"""Runs a command and holds it to a CPU-time budget: `python .ci/cpu_seconds.py LIMIT CMD...`.

Prints the CPU-seconds (user + system) the command and all its descendants used, and
exits non-zero when the command fails or the total is over LIMIT. CI holds the README's
test command to the project's limit with it, so the suite's cost cannot drift back
unnoticed.
"""

import resource
import subprocess
import sys


def main() -> int:
  limit, command = float(sys.argv[1]), sys.argv[2:]
  returncode = subprocess.run(command, check=False).returncode
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  seconds = usage.ru_utime + usage.ru_stime
  print(f"CPU-seconds: {seconds:.0f} (limit {limit:.0f}) for: {' '.join(command)}")
  if returncode != 0:
    return returncode
  if seconds > limit:
    print(f"over the limit of {limit:.0f} CPU-seconds: make tests cheaper, or move heavy "
          "checks to the slow tier (@pytest.mark.slow; see README, Testing)")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
