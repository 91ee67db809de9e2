"""`python -m examples.serve`: the serving binary (`examples/serve/serve.py`)."""

from absl import app

from examples.serve import serve

app.run(serve.main)
