# inf2serve: the two commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
CLI := $(VENV)/bin/inf2serve
STAMP := $(VENV)/.installed
RUN_DIR ?= .serve
DEMO_MODEL := demo/tiny-llama
DEMO_NAME := tiny-llama

# transformers 4.x overlays: this venv's interpreter with the Neuron SDKs' transformers.
# Each is a --no-deps --target directory; first on PYTHONPATH it replaces the venv's 5.x
# transformers, tokenizers and huggingface_hub (0.x, which needs requests), torch stays.
# 4.48 (transformers-neuronx era) and 4.57 (newest SDK) run the neuron-path tests again;
# 4.36, the floor transformers-neuronx accepts, joins the checkpoint and archive checks.
OVERLAY_DIR := $(VENV)/overlays
TF4_STACK := 4.48.3 4.57.6
TF4_ALL := 4.36.2 $(TF4_STACK)
tokenizers_4.36.2 := 0.15.2
tokenizers_4.48.3 := 0.21.4
tokenizers_4.57.6 := 0.22.2
OVERLAY_COMMON := huggingface_hub==0.36.0 requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.2
overlay = $(abspath $(OVERLAY_DIR))/transformers-$(1)
OVERLAY_STAMPS := $(foreach v,$(TF4_ALL),$(call overlay,$(v))/.installed)
empty :=
space := $(empty) $(empty)
TF4_OVERLAYS := $(subst $(space),:,$(foreach v,$(TF4_ALL),$(call overlay,$(v))))
# What runs on an Inf2 host and reads transformers (the CLI there, the neuron backends and
# fakes, the tokenizer's users), run again under each TF4_STACK overlay (tests comparing with
# the torch backend, which needs transformers 5, skip themselves there). What is slow and
# reads transformers only through the tokenizer runs under one overlay each, the SDK's own:
# transformers-neuronx's speculation under 4.48, NxD Inference's under 4.57. The scheduler,
# engine and engine-process tests are not here: their backend and tokenizer are pure Python.
# A neuron archive is served under every 4.x by tests/e2e/test_neuron_transformers4_e2e.py (in
# test-main), so the other end-to-end files run under 5 only.
NEURON_STACK_TESTS := $(filter-out tests/unit/test_neuron_speculation.py \
	tests/unit/test_nxdi_speculation.py,$(wildcard tests/unit/test_neuron_*.py \
	tests/unit/test_nxdi_*.py)) tests/unit/test_cache_*.py \
	tests/unit/test_cli_compile.py tests/unit/test_cli_inspect.py tests/unit/test_cli_package.py \
	tests/unit/test_validate_cmd.py tests/unit/test_config.py tests/unit/test_detokenize.py \
	tests/unit/test_openai_api.py tests/unit/test_synthetic_backend.py tests/unit/test_prompt_encoder.py \
	tests/unit/test_families.py tests/unit/test_backend_families.py tests/unit/test_family_matrix.py \
	tests/unit/test_structured.py
stack_only_4.48.3 := tests/unit/test_neuron_speculation.py
stack_only_4.57.6 := tests/unit/test_nxdi_speculation.py

# Most of the suite waits on TorchServe (JVM start, model load, streams), so test files run
# in parallel processes; a file's tests stay together to share its server (--dist loadfile).
PYTEST_WORKERS ?= 3
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile

# The runtime under a real CPython 3.10 (what Ubuntu 22.04 Inf2 hosts run): its modules
# import and the engine-process failure path answers, in a venv of the runtime's
# pure-Python dependencies (no torch: PyPI's Linux wheels are CUDA builds of several GB).
PY310 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10.*/bin/python3.10) \
	$(shell command -v python3.10 2>/dev/null))
VENV310 := .venv310
STAMP310 := $(VENV310)/.installed
# llguidance at the floor pyproject.toml accepts (1.6: the last built for glibc 2.17)
PY310_DEPS := pyyaml numpy safetensors httpx aiohttp rich psutil pytest jsonschema prometheus-client \
	transformers==4.57.6 tokenizers==0.22.2 huggingface_hub==0.36.0 llguidance==1.6.0
PY310_TESTS := tests/unit/test_py310_runtime.py tests/unit/test_scheduler.py \
	tests/unit/test_engine.py tests/unit/test_engine_client.py tests/unit/test_request.py \
	tests/unit/test_capabilities.py tests/unit/test_engine_messages.py tests/unit/test_structured.py

.PHONY: install install-browser install-prometheus install-test-tools overlays demo stop test test-main test-rest test-neuron-stack test-readme \
	test-py310 lint bench bench-device clean

install: $(STAMP)

# torch is installed first and pinned, so nothing later can pull a CUDA build.
$(STAMP): pyproject.toml
	@command -v java >/dev/null || { echo "installing a Java 17 runtime (TorchServe's frontend)"; \
	  $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -q && \
	  $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y -q openjdk-17-jre-headless; }
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[cpu,dev,bench,chat]"
	@touch $@

# Debian packages the tests drive, each installed only when missing, with one apt-get update
# for whatever is missing: chromium and its chromedriver (one build, so they always match),
# which the chat page's browser test drives (tests/e2e/test_chat_page_e2e.py); prometheus,
# promtool included and its recommended node exporter left out, which checks and unit-tests
# the alert rules (tests/unit/test_monitoring_rules.py) and scrapes a real server
# (tests/e2e/test_metrics_e2e.py).
BROWSER_PKGS := /usr/bin/chromium:chromium /usr/bin/chromedriver:chromium-driver
PROMETHEUS_PKGS := /usr/bin/prometheus:prometheus /usr/bin/promtool:prometheus
# $(call apt_install,PATH:PACKAGE ... (with recommends),PATH:PACKAGE ... (without))
define apt_install
	@missing() { for pair in "$$@"; do test -x $${pair%%:*} || echo $${pair#*:}; done | sort -u | xargs; }; \
	sudo=$$( [ "$$(id -u)" = 0 ] || echo sudo ); apt="$$sudo apt-get install -y -q -o DPkg::Lock::Timeout=600"; \
	with=$$(missing $(1)); without=$$(missing $(2)); \
	test -z "$$with$$without" || { echo "installing Debian's $$with $$without (what the tests drive)"; \
	  $$sudo apt-get update -q && \
	  { test -z "$$with" || $$apt $$with; } && { test -z "$$without" || $$apt --no-install-recommends $$without; }; }
endef

install-browser:
	$(call apt_install,$(BROWSER_PKGS),)

install-prometheus:
	$(call apt_install,,$(PROMETHEUS_PKGS))

install-test-tools:
	$(call apt_install,$(BROWSER_PKGS),$(PROMETHEUS_PKGS))

overlays: $(OVERLAY_STAMPS)

# built in DIR.tmp and renamed when it imports, so an interrupted build is redone
$(abspath $(OVERLAY_DIR))/transformers-%/.installed: | $(STAMP)
	@rm -rf $(@D) $(@D).tmp
	$(PY) -m pip install -q --no-deps --target $(@D).tmp transformers==$* \
	  tokenizers==$(tokenizers_$*) $(OVERLAY_COMMON) 2>&1 | grep -v "is ignored: it is neither" || true
	PYTHONPATH=$(@D).tmp $(PY) -c 'import transformers as t; assert t.__version__ == "$*", t.__version__'
	@mv $(@D).tmp $(@D) && touch $@

demo: install
	@test -f $(DEMO_MODEL)/config.json || $(CLI) demo-model $(DEMO_MODEL)
	$(CLI) package --config model_configs/tiny-llama-cpu.yaml --checkpoint $(DEMO_MODEL) \
	  --name $(DEMO_NAME) --format mar --out model_store --force
	@$(CLI) stop --run-dir $(RUN_DIR) >/dev/null
	@mkdir -p $(RUN_DIR)
	@set -o pipefail; $(CLI) serve --model-store model_store --models $(DEMO_NAME) \
	  --run-dir $(RUN_DIR) | tee $(RUN_DIR)/serve.txt
	@cmd=$$(sed -n 's/^  \(curl .*\)$$/\1/p' $(RUN_DIR)/serve.txt); \
	echo; echo "streaming a reply with the curl command above (random weights, so the text is gibberish):"; \
	eval "$$cmd" || { echo; echo "the request failed; the server's logs are in $(RUN_DIR)/logs"; exit 1; }; \
	echo; echo; \
	echo "the server keeps running; try the curl command above, then stop it with: make stop"

stop:
	@test -x $(CLI) && $(CLI) stop --run-dir $(RUN_DIR) || echo "nothing to stop"

# After the main suite, the other three run side by side: the README check mostly waits
# (servers starting and stopping: ~150 s of CPU in ~250 s), which the neuron-stack and
# Python 3.10 runs fill; each target's output is printed whole when it ends (-O).
test: test-main
	@$(MAKE) --no-print-directory -j3 -O test-rest

test-rest: test-neuron-stack test-py310 test-readme

# One torch thread per test process (tests/conftest.py says why; the README's commands
# are not pytest, so the variable is set here as well).
test test-main test-rest test-neuron-stack test-py310 test-readme: export OMP_NUM_THREADS := 1
# Bytecode written, as on a user's machine, even where the environment says not to (CI's
# does): otherwise every process the suite starts compiles our sources again, and every
# pytest process rewrites and compiles every test module again (~6 s of CPU per collection).
test test-main test-rest test-neuron-stack test-py310 test-readme: export PYTHONDONTWRITEBYTECODE :=

# the whole suite on the tested pins; checkpoint and archive checks also load under TF4_ALL
# (the 25 slowest tests are listed at the end, for where CI time goes)
test-main: install install-test-tools overlays
	INF2SERVE_TF4_OVERLAYS=$(TF4_OVERLAYS) $(PY) -m pytest tests -q $(PYTEST_PARALLEL) --durations=25

# one overlay's run: its transformers checked, then the stack's tests and its own
stack_run = echo "== neuron-path tests under transformers $(1)" \
	&& PYTHONPATH=$(call overlay,$(1)) $(PY) -c "import transformers as t; assert t.__version__ == '$(1)', t.__file__" \
	&& PYTHONPATH=$(call overlay,$(1)) $(PY) -m pytest -q $(PYTEST_PARALLEL) $(NEURON_STACK_TESTS) $(stack_only_$(1))

test-neuron-stack: install overlays
	@$(foreach v,$(TF4_STACK),$(call stack_run,$(v)) &&) true

$(STAMP310): pyproject.toml
	@test -n "$(PY310)" || { echo "no CPython 3.10 found: install one (pyenv install 3.10, or \
	apt-get install python3.10-venv) or pass PY310=/path/to/python3.10"; exit 1; }
	@rm -rf $(VENV310) && $(PY310) -m venv $(VENV310)
	$(VENV310)/bin/python -m pip install -q --no-deps -e .
	$(VENV310)/bin/python -m pip install -q $(PY310_DEPS)
	@touch $@

test-py310: $(STAMP310)
	$(VENV310)/bin/python -m pytest -q -p no:cacheprovider $(PY310_TESTS)

# every command block of README.md, then of docs/*.md (GUIDES in .ci/readme_commands.py),
# in order, in a fresh copy of the repository (this venv)
test-readme: install install-prometheus
	MAKEFLAGS= $(PY) .ci/readme_commands.py --venv $(VENV)

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) bench/run_bench.py --out bench/results

# only the device-bound scenario (synthetic device, host efficiency): a few minutes
bench-device: install
	$(PY) bench/run_bench.py --only device-bound --out bench/results

clean: stop
	rm -rf $(RUN_DIR) model_store demo bench/work
