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
	rm -rf runs/tiny_sft runs/tiny_grpo
	$(BIN)/python -m osvl.world build --out runs/demo/world --seed 0
	$(BIN)/python -m osvl.synth run --world runs/demo/world --out runs/demo/data > runs/demo/curation.json
	$(BIN)/python -m osvl.trainer.demo tokenizer --data runs/demo/data
	$(BIN)/torchrun --standalone --nproc_per_node 2 -m osvl.train --recipe tiny_sft --set metrics.tensorboard=false
	$(BIN)/torchrun --standalone --nproc_per_node 2 -m osvl.train --recipe tiny_grpo --set metrics.tensorboard=false
	$(BIN)/python -m osvl.report runs/tiny_sft > /dev/null
	$(BIN)/python -m osvl.report runs/tiny_grpo > /dev/null
	$(BIN)/python -m osvl.trainer.demo summary --sft runs/tiny_sft --grpo runs/tiny_grpo --window 2

bench-cpu: install
	$(BIN)/python bench/kernels/bench_grpo_loss.py --device cpu

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
