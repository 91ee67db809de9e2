"""Two processes (jax.distributed, gloo on loopback) behave like one process with 8 devices."""

import os
import queue
import re
import subprocess
import sys
import threading

import numpy as np
from examples.train import launch
import harness
import multihost_worker
import oracle
import processes

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = processes.env()
FINAL = re.compile(r"^final step=(\d+) loss=([0-9.]+) accuracy=([0-9.]+)$", re.M)
STEP = re.compile(r"\] step=(\d+) loss=([0-9.]+)")


def test_attention_on_a_mesh_spanning_two_processes_equals_one_process(tmp_path):
  out_file = str(tmp_path / "out.npz")
  codes = launch.launch([sys.executable, os.path.join(HERE, "multihost_worker.py"), out_file],
                        num_processes=2, devices_per_process=4, timeout=300, env=ENV)
  assert codes == [0, 0]
  got = np.load(out_file)
  q, k, v, seg, sinks = multihost_worker.inputs()
  rules = dict(window=multihost_worker.CONFIG["sliding_window"],
               soft_cap=multihost_worker.CONFIG["logits_soft_cap"], q_seg=seg, sinks=sinks)
  out, _ = oracle.attention(q, k, v, **rules)
  _, grads = oracle.out_and_vjp(q, k, v, 2 * out, **rules)  # the worker's loss: sum(out ** 2)
  for i, want in enumerate((out, *grads)):
    np.testing.assert_allclose(got[f"arr_{i}"], want, atol=2e-5, rtol=2e-5, err_msg=f"arr_{i}")

def _run(*args, timeout=420):
  proc = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=ENV,
                        timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def test_training_across_two_processes_matches_one_process():
  # The sequence load-balanced over sp = 4 devices spanning both processes (sp first in the
  # mesh), attended Ulysses-style: its all-to-alls cross the process boundary (the prefix-LM
  # ids gathered with the sequence). The one-process run is test_train's too: it compiles once.
  flags = ["examples.train", *harness.SHARDED_TRAINING_FLAGS]
  two = _run("examples.train.launch", "--timeout=400", "--", sys.executable, "-m", *flags,
             "--mesh=sp=4,dp=2", "--sequence_strategy=ulysses", "--load_balanced")
  one = _run(*flags)
  assert "(Ulysses over" in two.stderr, two.stderr[-2000:]
  assert len(FINAL.findall(two.stdout)) == 1  # only process 0 prints
  (two_final,), (one_final,) = FINAL.findall(two.stdout), FINAL.findall(one.stdout)
  assert abs(float(two_final[1]) - float(one_final[1])) < 1e-4
  two_step = dict(STEP.findall(two.stderr))["20"]
  one_step = dict(STEP.findall(one.stderr))["20"]
  assert abs(float(two_step) - float(one_step)) < 1e-4


def _stderr_lines(proc: subprocess.Popen) -> queue.Queue:
  """proc's stderr lines fed into a queue by a thread, so that waiting for one can time out."""
  lines = queue.Queue()

  def feed():
    for line in proc.stderr:
      lines.put(line)
    lines.put(None)  # the stream ended

  threading.Thread(target=feed, daemon=True).start()
  return lines


def _read_until(lines: queue.Queue, needle: str, seconds: float) -> str:
  """Lines until one holds `needle`, the stream ends, or none came for `seconds` (a hang)."""
  seen = ""
  while needle not in seen:
    try:
      line = lines.get(timeout=seconds)
    except queue.Empty:
      break
    if line is None:
      break
    seen += line
  return seen


def _start_training_pair():
  """Two training processes; process 0 has logged step 10. Retries a port taken meanwhile."""
  for _ in range(3):
    port = launch.free_port()
    command = lambda i: [sys.executable, "-m", "examples.train", "--steps=100000",
                         "--log_every=10", f"--coordinator_address=127.0.0.1:{port}",
                         "--num_processes=2", f"--process_id={i}", "--cpu_devices=4",
                         "--heartbeat_timeout=5", "--num_layers=1", "--seq_len=15",
                         "--batch_size=8"]
    procs = [subprocess.Popen(command(i), stdout=subprocess.DEVNULL, text=True, env=ENV,
                              stderr=subprocess.PIPE if i == 0 else subprocess.DEVNULL)
             for i in range(2)]
    lines = _stderr_lines(procs[0])
    seen = _read_until(lines, "step=10 ", seconds=120)
    if "step=10 " in seen or launch.BIND_FAILED not in seen:
      return procs, lines, seen
    _stop(procs)
  return procs, lines, seen


def _stop(procs) -> None:
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.wait()


def test_a_killed_process_makes_the_other_exit_not_hang():
  procs, lines, seen = _start_training_pair()
  try:
    assert "step=10 " in seen, seen[-2000:]
    procs[1].kill()
    procs[0].wait(timeout=120)  # a hang fails here; JAX's heartbeat takes --heartbeat_timeout
    assert procs[0].returncode != 0
    stderr = seen + _read_until(lines, "\0", seconds=30)  # to the end of the stream
    assert "another task died" in stderr or "error:" in stderr, stderr[-2000:]
  finally:
    _stop(procs)


def test_launcher_stops_the_others_when_one_fails(capfd):
  script = ("import sys, time\n"
            "if '--process_id=1' in sys.argv: sys.exit(3)\n"
            "time.sleep(600)\n")
  codes = launch.launch([sys.executable, "-c", script], num_processes=2, devices_per_process=1,
                        timeout=300, env=ENV)
  assert codes[1] == 3 and codes[0] != 0
  assert "process 1 exited with 3; stopping the others" in capfd.readouterr().err
