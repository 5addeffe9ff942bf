# inf2serve: the two commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
CLI := $(VENV)/bin/inf2serve
STAMP := $(VENV)/.installed
RUN_DIR ?= .serve
DEMO_MODEL := demo/tiny-llama
DEMO_NAME := tiny-llama
PROMPT ?= Once upon a time

.PHONY: install demo stop test lint bench clean

install: $(STAMP)

# torch is installed first and pinned, so nothing later can pull a CUDA build.
$(STAMP): pyproject.toml
	@command -v java >/dev/null || { echo "installing a Java 17 runtime (TorchServe's frontend)"; \
	  $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -q && \
	  $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y -q openjdk-17-jre-headless; }
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,bench]"
	@touch $@

demo: install
	@test -f $(DEMO_MODEL)/config.json || $(CLI) demo-model $(DEMO_MODEL)
	$(CLI) package --config model_configs/tiny-llama-cpu.yaml --checkpoint $(DEMO_MODEL) \
	  --name $(DEMO_NAME) --format mar --out model_store --force
	@$(CLI) stop --run-dir $(RUN_DIR) >/dev/null
	$(CLI) serve --model-store model_store --models $(DEMO_NAME) --run-dir $(RUN_DIR)
	@url=$$($(PY) -c 'import json;print(json.load(open("$(RUN_DIR)/server.json"))["inference_url"])'); \
	token=$$($(PY) -c 'import json;print(json.load(open("$(RUN_DIR)/key_file.json"))["inference"]["key"])'); \
	cmd="curl -sN -H 'Authorization: Bearer $$token' -H 'Content-Type: application/json' $$url/predictions/$(DEMO_NAME) -d '{\"prompt\": \"$(PROMPT)\", \"max_new_tokens\": 48}'"; \
	echo; echo "streaming a reply (random weights, so the text is gibberish):"; echo "  $$cmd"; echo; \
	eval "$$cmd"; echo; echo; \
	echo "the server keeps running; try the command above, then stop it with: make stop"

stop:
	@test -x $(CLI) && $(CLI) stop --run-dir $(RUN_DIR) || echo "nothing to stop"

test: install
	$(PY) -m pytest tests -q

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) bench/run_bench.py --out bench/results

clean: stop
	rm -rf $(RUN_DIR) model_store demo bench/work
