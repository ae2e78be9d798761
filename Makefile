# The two commands of the README's quick start.
.PHONY: demo test lint setup reference peers docs docs-serve
# Independent prerequisites build side by side (`make test`: .venv with the lint, and .venv-reference; their
# few lines of output may interleave).
MAKEFLAGS += --jobs=2

setup:
	bash dev/setup.sh

# A real 2-process training run on CPU: fine-tune MiniLM on movie-review sentiment.
demo: setup
	.venv/bin/lockstep launch --num-processes 2 examples/sentiment_loop.py

# The documentation site (mkdocs.yml): built into site/ with --strict (a broken link or reference fails);
# docs-serve serves it on http://127.0.0.1:8000 and rebuilds on change. NO_MKDOCS_2_WARNING hides
# mkdocs-material's banner about its successor.
docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs serve

lint: setup
	.venv/bin/ruff check src tests examples bench docs/_gen
	.venv/bin/ruff format --check src tests examples bench docs/_gen

# The real Accelerate and transformers in .venv-reference, for the reference tests (tests/reference/).
reference:
	bash dev/reference_env.sh

# The peers (Accelerate, Lightning Fabric) beside lockstep in bench/peers/.venv: bench/peers/run's
# environment, which tests/bench/test_peers_harness.py runs at --quick sizes.
peers:
	bash bench/peers/setup.sh

# Two pytest workers (pytest-xdist), each file's tests on one worker (module fixtures stay shared): the
# multi-process tests wait on each other a good part of the time, and two workers on the 2-core CI machine
# took 122 s where one took 200 (tests/checkpoint). The slowest tests are listed at the end. Bytecode caching on,
# as on a user's machine: with PYTHONDONTWRITEBYTECODE=1 (this workplace sets it) every process the tests start
# compiles lockstep's and the tests' sources again (tests/launcher/test_launch_flags_e2e.py and
# tests/e2e/test_cluster_launch.py: 38.3 CPU-s cached against 39.3-41.3 without).
test: lint reference peers
	env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=30
