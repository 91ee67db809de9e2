"""`python -m examples.train`: the training binary (`examples/train/train.py`)."""

from absl import app

from examples.train import train

app.run(train.main)
