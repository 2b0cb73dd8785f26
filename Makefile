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

# The demo world is the mini-world at 3x its entity counts, and the expert asks text_search for
# one passage (half the tokens). A policy trained from random weights must first learn to copy a
# name it just read into its next query, which a pretrained base already does: lookup drills
# (osvl/synth/drills.py, RL entities left out) join the expert chains for that. Greedy
# evaluations on held-out RL prompts bracket each stage.
DEMO_EVAL := $(BIN)/python -m osvl.trainer.demo evaluate --recipe tiny_grpo --limit 32
demo: install
	rm -rf runs/demo runs/tiny_sft runs/tiny_grpo
	$(BIN)/python -m osvl.world build --out runs/demo/world --seed 0 --scale 3
	$(BIN)/python -m osvl.synth run --world runs/demo/world --out runs/demo/data --expert-search-top-k 1 > runs/demo/curation.json
	$(BIN)/python -m osvl.synth drills --world runs/demo/world --data runs/demo/data --count 3000 --out runs/demo/data/sft/drills.jsonl
	cat runs/demo/data/sft/trajectories.jsonl runs/demo/data/sft/drills.jsonl > runs/demo/data/sft/with_drills.jsonl
	$(BIN)/python -m osvl.trainer.demo tokenizer --data runs/demo/data --vocab-size 768
	$(DEMO_EVAL) --checkpoint init --out runs/demo/eval/init.json
	$(BIN)/torchrun --standalone --nproc_per_node 2 -m osvl.train --recipe tiny_sft --set metrics.tensorboard=false
	$(DEMO_EVAL) --checkpoint runs/tiny_sft/hf --out runs/demo/eval/sft.json
	$(BIN)/torchrun --standalone --nproc_per_node 2 -m osvl.train --recipe tiny_grpo --set metrics.tensorboard=false
	$(DEMO_EVAL) --checkpoint runs/tiny_grpo/hf --out runs/demo/eval/grpo.json
	$(BIN)/python -m osvl.report runs/tiny_sft > /dev/null
	$(BIN)/python -m osvl.report runs/tiny_grpo > /dev/null
	$(BIN)/python -m osvl.trainer.demo summary --sft runs/tiny_sft --grpo runs/tiny_grpo --window 2 \
		--evals init=runs/demo/eval/init.json sft=runs/demo/eval/sft.json grpo=runs/demo/eval/grpo.json

bench-cpu: install
	$(BIN)/python bench/kernels/bench_grpo_loss.py --device cpu

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
