r"""Launches a multi-process JAX program on this host (loopback), one process per "host".

  python -m examples.train.launch --num_processes=2 --devices_per_process=4 -- \
      python -m examples.train --mesh=dp=2,tp=4

Each process gets `--coordinator_address --num_processes --process_id
--cpu_devices` appended. Waits for all; if one fails (or --timeout passes),
the others are stopped and the launcher exits non-zero, saying which failed.
"""

from __future__ import annotations

import collections
import socket
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags

_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "Processes to start.")
_DEVICES_PER_PROCESS = flags.DEFINE_integer("devices_per_process", 4, "CPU devices per process.")
_TIMEOUT = flags.DEFINE_float("timeout", 600, "Seconds before all processes are stopped.")


# What the coordinator prints when its port was taken between picking it and binding it.
BIND_FAILED = "Failed to add port"


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(command: list[str], num_processes: int, devices_per_process: int,
           timeout: float, env: dict[str, str] | None = None, attempts: int = 3) -> list[int]:
  """Runs `command` as `num_processes` cooperating processes; returns their exit codes.

  A free port can be taken by another program before the coordinator binds it;
  a run that failed that way is retried on another port (`attempts` in all).
  """
  for attempt in range(attempts):
    codes, tails = _launch_once(command, num_processes, devices_per_process, timeout, env)
    if not any(codes) or not any(BIND_FAILED in line for tail in tails for line in tail):
      break
    sys.stderr.write(f"launch: the coordinator's port was taken (attempt {attempt + 1}); "
                     "retrying on another\n")
  return codes


def _relay(stream, tail: collections.deque) -> None:
  """Copies a child's stderr to ours line by line, keeping its last lines."""
  for line in stream:
    sys.stderr.write(line)
    tail.append(line)


def _launch_once(command, num_processes, devices_per_process, timeout, env):
  address = f"127.0.0.1:{free_port()}"
  procs = [subprocess.Popen(command + [f"--coordinator_address={address}",
                                       f"--num_processes={num_processes}", f"--process_id={i}",
                                       f"--cpu_devices={devices_per_process}"], env=env,
                            stderr=subprocess.PIPE, text=True)
           for i in range(num_processes)]
  tails = [collections.deque(maxlen=100) for _ in procs]
  relays = [threading.Thread(target=_relay, args=(p.stderr, t), daemon=True)
            for p, t in zip(procs, tails)]
  for r in relays:
    r.start()
  deadline = time.time() + timeout
  try:
    while any(p.poll() is None for p in procs):
      failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
      if failed or time.time() > deadline:
        why = f"process {failed[0]} exited with {procs[failed[0]].returncode}" if failed else (
            f"timed out after {timeout:.0f} s")
        sys.stderr.write(f"launch: {why}; stopping the others\n")
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.terminate()
    for p in procs:
      try:
        p.wait(timeout=10)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    for r in relays:
      r.join(timeout=10)
  return [p.returncode for p in procs], tails


def main(argv):
  command = argv[1:]
  if command and command[0] == "--":
    command = command[1:]
  if not command:
    sys.exit("error: give the command to launch after --")
  codes = launch(command, _NUM_PROCESSES.value, _DEVICES_PER_PROCESS.value, _TIMEOUT.value)
  if any(codes):
    sys.exit(f"error: exit codes {codes}")


if __name__ == "__main__":
  app.run(main)
