# `make demo` and `make test` work on a fresh machine with python3: they create .venv,
# install the CPU build of torch 2.13.0 first (an unpinned torch would pull CUDA), then the project.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo demo-apply demo-resume test test-compat install
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: install
	$(BIN)/tailor-tui --demo

demo-apply: install
	$(BIN)/tailor-tui --make-demo demo-run
	$(BIN)/tailor-tui --apply recipes/demo.yaml --force

# resume the composed demo checkpoint with the real HF Trainer on 2 ranks, one step: its step and loss
demo-resume: demo-apply
	$(BIN)/python -m tailor_tui.demo.demo_run resume-demo demo-run/checkpoint-6-demo-recipe

# three test processes on CI's 2 cores: much of the suite waits (pilot pauses, compositions slowed to be
# signalled, peer timeouts), so a third keeps the cores busy (two used 77% of them: 16:34, three 14:28). The
# real runs each test needs are made once, by whichever process needs one first, and the tests sharing a
# module's compositions run in one process (`tests/groups.py`: before the groups held, each process made
# them all, and three were slower than two). Under
# eatmydata where it is installed (.ci/run installs it): thousands of small outputs are each fsynced
# before they are published, which no test can tell from a no-op (tests that check the fsyncs record
# the calls), and would otherwise tie the suite's time to the disk's
EATMYDATA := $(shell command -v eatmydata 2>/dev/null)
test: install
	$(EATMYDATA) $(BIN)/python -m pytest -n 3 --dist loadgroup --durations=30

# every DeepSpeed release of tests/test_compat.py (`make test` runs the oldest and the newest)
test-compat: install
	$(BIN)/python -m pytest tests/test_compat.py --deepspeed-releases all
