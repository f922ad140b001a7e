# agnosia — one make target per stage. Each is a thin wrapper over `python -m <stage>`;
# every module answers --help.  On a fresh machine `make demo` and `make test` are all you need.

SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.agnosia-installed
DATA   ?= data
STIMULI ?= sets
# Stimulus sets written by `make stimuli` (small: seconds on 2 cores).
STIMULI_ARGS ?= --seed 0

MANIFEST ?= manifests/demo.yaml

REPORT ?= report

PLAN ?= manifests/probes-demo.yaml

.PHONY: help setup browser lint test test-fast faults stimuli extract probes info verify report toy-model toy-mas toy-g2m variants g2m tricks demo bench clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_-]+:.*## / {printf "  \033[1m%-10s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: $(STAMP) ## create .venv and install agnosia with pinned packages (idempotent)

$(STAMP): pyproject.toml requirements.lock setup.py probes/_halfpool.c store/_halfcast.c store/_clones.h
	@test -x $(PY) || python3.11 -m venv $(VENV) 2>/dev/null || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c requirements.lock torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -c requirements.lock -e '.[dev]'
	@touch $(STAMP)
	@echo "agnosia installed in $(VENV)"

browser: ## install Debian's headless Chromium for the report test (as root, with apt), if missing
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium (Debian) for the report test"; \
	    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "no Chromium and not root: the report's browser test will be skipped ('sudo make browser' runs it)"; fi; }

lint: setup ## ruff (style, imports, bugbear) and mypy over the packages: clean before every commit
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The test targets write bytecode even where the environment turns it off (PYTHONDONTWRITEBYTECODE=1):
# otherwise pytest re-rewrites the asserts of ~200 test modules in each worker on every run (~5 s each).
test: setup browser ## run the test suite
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n 2 --dist loadfile --durations=10

test-fast: setup ## the quick loop: every test not marked slow or browser
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n 2 --dist loadfile -m "not slow and not browser" --durations=10

faults: setup ## the fault-injection suite alone (kill -9, full disk, dead Dask workers, damaged files; docs/reliability.md)
	$(PY) -m pytest -q tests/faults

stimuli: setup ## write a small set of each stimulus family to $(STIMULI)/ (the manifests' sets/... are read from there)
	$(PY) -m stimuli all --out $(STIMULI) $(STIMULI_ARGS)

extract: setup ## run (or resume) an extraction manifest into $(DATA): make extract MANIFEST=manifests/x.yaml
	$(PY) -m extract $(MANIFEST) --data $(DATA) --stimuli-root $(STIMULI)

probes: setup ## train a probe plan's probes on Dask from the stored activations: make probes PLAN=manifests/x.yaml
	$(PY) -m probes $(PLAN) --data $(DATA)

info: setup ## what the workspace $(DATA) holds: runs, arrays, sizes (read only; `make report` writes the report)
	$(PY) -m store info --data $(DATA)

verify: setup ## check every committed chunk of $(DATA) against the manifest (exit 1 on problems)
	$(PY) -m store verify --data $(DATA)

toy-model: setup ## retrain the counting lab's toy VLM from scratch (lab/toy.yaml) into lab/checkpoints/toy-counter
	$(PY) -m lab.train

toy-g2m: setup ## retrain the G2M toy (g2m, lab/toy-g2m.yaml) from scratch into lab/checkpoints/toy-g2m and write its card
	$(PY) -m lab.train --config lab/toy-g2m.yaml --out lab/checkpoints/toy-g2m --threads 1
	$(PY) -m lab.g2m card lab/checkpoints/toy-g2m --threads 1

toy-mas: setup ## MAS-fine-tune the toy model (study counting-tricks) into lab/checkpoints/toy-counter-mas
	$(PY) -m lab.mas --out lab/checkpoints/toy-counter-mas --steps 150 --tau 0.9 --lam 0.1 --threads 1

# The demo's runs, by the target that makes them. Each target extracts its manifests in one process
# (`python -m extract M1 M2 ...`): torch and transformers load once, not once per manifest.
VARIANT_MANIFESTS := $(patsubst %,manifests/demo-%.yaml,text heads-visual heads-text rope compression mas)
TRICKS_MANIFESTS  := manifests/demo-counting-tricks.yaml manifests/demo-spatial.yaml

define G2M_SETS
	for n in 6 8 10; do $(PY) -m stimuli g2m --out $(STIMULI)/g2m-toy-n$$n --n 16 --grid-sizes $$n \
	  --colors 3 --image-size $$((8 * n)) --seed 30000 --overwrite || exit 1; done
endef

define TRICKS_SETS
	$(PY) -m stimuli counting --out $(STIMULI)/counting-toy --n 4 --image-size 88 --patch-size 8 --count-min 1 \
	  --count-max 6 --seed 3 --overwrite
	$(PY) -m stimuli spatial --out $(STIMULI)/spatial-toy --n 48 --image-size 88 --seed 4 --overwrite
endef

VARIANT_QUERIES := $(PY) -m queries interventions --data $(DATA) && \
	$(PY) -m queries head_overlap --data $(DATA) --param a=toy-heads-visual --param b=toy-heads-text
G2M_QUERY := $(PY) -m queries g2m_gap --data $(DATA) --param run=toy-g2m

variants: setup ## the interventions on the toy model as variant runs into $(DATA) (after make demo's stimuli)
	$(PY) -m extract $(VARIANT_MANIFESTS) --data $(DATA) --stimuli-root $(STIMULI) --no-progress
	$(VARIANT_QUERIES)

g2m: setup ## the G2M toy over grids of N = 6 (trained), 8 and 10 into $(DATA): extraction, spatial probes, the gap
	$(G2M_SETS)
	$(PY) -m extract manifests/demo-g2m.yaml --data $(DATA) --stimuli-root $(STIMULI) --no-progress
	$(PY) -m probes manifests/probes-demo-g2m.yaml --data $(DATA) --no-progress
	$(G2M_QUERY)

tricks: setup ## CountingTricks and spatial scenes on the toy model into $(DATA) (88 px, its own 8 px patches), detection probes
	$(TRICKS_SETS)
	$(PY) -m extract $(TRICKS_MANIFESTS) --data $(DATA) --stimuli-root $(STIMULI) --no-progress
	$(PY) -m probes manifests/probes-demo-counting-tricks.yaml --data $(DATA) --no-progress

report: setup ## write the HTML report of $(DATA) to $(REPORT)/index.html
	$(PY) -m queries.report --data $(DATA) --out $(REPORT)

# What `variants`, `g2m` and `tricks` do, reordered: every stimulus set first, then all ten extractions in
# one process, the three probe plans in another, then the queries and the report.
demo: setup ## the whole pipeline on the committed toy model: stimuli, extraction, probes, queries, report
	$(PY) -m stimuli all --out $(STIMULI) $(STIMULI_ARGS)
	$(PY) -m stimuli go --preset small --variation mild --n 4 --seed 1 --out $(STIMULI)/go-toy --overwrite
	$(G2M_SETS)
	$(TRICKS_SETS)
	$(PY) -m extract manifests/demo.yaml manifests/demo-contrastive.yaml $(VARIANT_MANIFESTS) manifests/demo-g2m.yaml \
	  $(TRICKS_MANIFESTS) \
	  --data $(DATA) --stimuli-root $(STIMULI)
	$(PY) -m probes manifests/probes-demo.yaml manifests/probes-demo-g2m.yaml manifests/probes-demo-counting-tricks.yaml \
	  --data $(DATA) --no-progress
	$(PY) -m probes sae manifests/sae-demo.yaml --data $(DATA)
	$(PY) -m queries counting_regimes --data $(DATA)
	$(PY) -m queries attractors --data $(DATA) --param min_share=0.1
	$(VARIANT_QUERIES)
	$(G2M_QUERY)
	$(PY) -m queries.report --data $(DATA) --out $(REPORT)
	@echo
	@echo "Done: $(DATA) holds every run, $(REPORT)/index.html the report. Three things to try next:"
	@echo "  $(PY) -m queries lost --data $(DATA) --param run=toy-counter-go --param target=truth:count% --param \"group_by=truth->>'regime'\""
	@echo "  $(PY) -m queries --data $(DATA) --sql \"SELECT run, family, avg(correct::INT) AS accuracy FROM v_samples GROUP BY ALL\""
	@echo "  $(PY) -m queries probe_leaderboard --data $(DATA)"

bench: setup ## measure the performance aims side by side; figures recorded in bench/results/ (`python -m bench table` puts them in docs/benchmarks.md)
	$(PY) -m bench

clean: ## remove generated stimuli and the default workspace (keeps .venv)
	rm -rf $(STIMULI) $(DATA) $(REPORT)
