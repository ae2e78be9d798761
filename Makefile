# The two commands of the README's quick start.
.PHONY: demo test lint setup reference

setup:
	bash dev/setup.sh

# A real 2-process training run on CPU: fine-tune MiniLM on movie-review sentiment.
demo: setup
	.venv/bin/lockstep launch --num-processes 2 examples/sentiment_loop.py

lint: setup
	.venv/bin/ruff check src tests examples bench
	.venv/bin/ruff format --check src tests examples bench

# The real Accelerate and transformers in .venv-reference, for the reference tests (tests/reference/).
reference:
	bash dev/reference_env.sh

test: lint reference
	.venv/bin/python -m pytest -q
