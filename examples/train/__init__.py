"""The absl training binary and what only it uses: model, data, checkpoints, sampling, launcher.

  python -m examples.train --steps=300
"""
