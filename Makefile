# Two entry points (README): `make test` and `make demo`. Both install first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch 2.13.0 ships on the CI image; a looser pin would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
TRITON_PIN ?= triton==3.7.1
PYTEST_WORKERS ?= 2

.PHONY: install test demo bench-cpu clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile $(wildcard requirements/*.txt)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_PIN)" "$(TRITON_PIN)"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps -r requirements/runtime-no-deps.txt -r requirements/test-no-deps.txt
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

test: install
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) tests

demo: install
	@echo "make demo: the trainer (osvl.train) is not built yet; see the open trainer issue." >&2
	@exit 2

bench-cpu: install
	$(BIN)/python bench/kernels/bench_grpo_loss.py --device cpu

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
