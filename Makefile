# liftoff: every target sets itself up; `make run` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=
SWEEP  ?= train.lr=1e-3,3e-3
IMAGE  ?= ghcr.io/liftoff/liftoff
TORCH_VARIANT ?= cuda

.PHONY: install browser run test chaos lint compile upload sweep submit bench images clean

install: $(STAMP)

# torch first, pinned: resolved with the rest, a looser spec could pull another (multi-GB CUDA) build.
# (this machine installs 2.13.0 as a CPU build from local disk; elsewhere see deploy/README.md step 0)
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# Debian packages the tests need, once per machine (root, or sudo): headless Chromium for the
# eval report's screenshot test, g++ for the inductor test (the compiler the image installs),
# prometheus and promtool for the metrics and alert-rule tests.
browser:
	@{ command -v chromium && command -v g++ && command -v prometheus && command -v promtool; } >/dev/null 2>&1 || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo -n); \
		echo "installing chromium, g++ and prometheus (Debian packages) for the tests"; \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core g++ prometheus >/dev/null; }

run: install            ## the tiny CPU experiment, all five stages through kfp.local
	$(BIN)/liftoff run $(ARGS)

test: install browser   ## the test suite (fast chaos tests included)
	$(BIN)/python -m pytest -q -m "not chaos_slow" --durations=25 $(ARGS)

chaos: install browser  ## every chaos test, then the summary table; then the long tests make test leaves out
	$(BIN)/python -m pytest -q tests/chaos $(ARGS)
	$(BIN)/python -m pytest -q -m chaos_slow --ignore=tests/chaos $(ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/hadolint images/Dockerfile

compile: install
	$(BIN)/liftoff compile $(ARGS)

upload: install
	$(BIN)/liftoff upload $(ARGS)

sweep: install          ## make sweep SWEEP="train.lr=1e-3,3e-3"
	$(BIN)/liftoff run -m $(SWEEP) $(ARGS)

submit: install
	$(BIN)/liftoff submit $(ARGS)

bench: install
	$(BIN)/python -m benchmarks $(ARGS)

images:                 ## the stage image, tagged with the git commit it was built from (needs a Docker engine)
	git diff --quiet HEAD || { echo "commit first: the image's tag and code version name a commit"; exit 1; }
	docker build -f images/Dockerfile --build-arg TORCH_VARIANT=$(TORCH_VARIANT) \
		--build-arg GIT_COMMIT=$$(git rev-parse HEAD) -t $(IMAGE):$$(git rev-parse --short=10 HEAD) .
	@echo "run it with cluster.image=$(IMAGE):$$(git rev-parse --short=10 HEAD)"

clean:
	rm -rf $(VENV) build artifacts runs local_outputs outputs multirun .cache .pytest_cache .ruff_cache
