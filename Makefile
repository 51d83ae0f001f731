# decentpy developer entry points.
#
#   make train   a real 4-worker decentralized training run on CPU (WORKERS=4 ARGS="--epochs 5")
#   make test    C++ tests (ctest, when cmake is present) and the Python tests
#   make bench   kernel microbenchmarks
#   make bench-outer        the fused outer step of local-steps training (pack + apply) vs torch ops and a copy
#   make bench-straggler    DiLoCo with one worker slowed 2x: a fixed H against a time budget (sync_every_s)
#   make bench-train        end-to-end step time: decentpy vs decent-dp vs torch DDP vs no comm (BENCH_ARGS=...;
#                           BENCH_ARGS="--link-mbit 400 --link-layout two-nodes": throttled links, root only)
#   make bench-shard        sharded data parallel: decentpy OSS+ShardedDataParallel vs torch ZeRO vs DDP vs
#                           fairscale (2 and 4 workers; BENCH_ARGS=...)
#   make bench-fairscale-parity  fairscale's benchmarks/oss.py on CPU (ResNet-18, digits, 2 workers, RMSprop,
#                           oss_ddp / oss_sharded_ddp, +AMP): loss curves of torch DDP, fairscale, decentpy
#                           (BENCH_ARGS=...)
#   make bench-pipe         pipeline parallelism: decentpy AsyncPipe vs torch.distributed.pipelining (GPipe, 1F1B)
#                           vs one process (2 and 4 stages, chunks 1..16; BENCH_ARGS=...)
#   make bench-hybrid       2 nodes x 2 ranks: decentpy vs torch DDP / ZeRO, pipelines with gossip vs all-reduce:
#                           step time, optimizer state, peak memory, bytes intra / inter node (BENCH_ARGS=...)
#   make bench-convergence  fixed-budget accuracy of each topology x optimizer vs DDP on digits
#   make bench-faults       elastic gossip under SIGKILLs + replacements vs the same run without faults, torch DDP
#                           with torchrun restarts + checkpoints, torchft if BENCH_TORCHFT_PATH=dir (CSV, plot)
#   make bench-elastic      the per-step cost of ElasticGossip against plain DecentralizedDataParallel, no faults
#   make bench-lm           a byte-level transformer LM on the stdlib's source, the race users run: by default each
#                           arm's final held-out loss in DDP's wall time for 1M tokens, on loopback and behind
#                           100 Mbit/s links (root), torch DDP, decent-dp and decentpy at their best swept settings
#                           (BENCH_ARGS="--race --arms ... --links loopback,1000,100 --seeds 0,1"; without --race:
#                           equal tokens; --sweep: each arm's settings sweep)
#   make runtime-model      analytic runtime model, calibrated on bench-train's CSV when present
#   make build   create .venv, install the dependencies, build the extension (editable install)
#   make wheel   build a wheel into dist/ (e.g. decentpy-0.1.0+cu130.torch213.sm80.sm90-...whl);
#                honours DECENTPY_CUDA_ARCHS, CUDA_HOME, DECENTPY_NO_CUDA (docs/wheels.md)
#   make docs    the documentation site (Sphinx, warnings are errors) into docs/_build/html
#   make clean   remove build outputs (keeps .venv);  make distclean  also removes .venv
#   make help    this list
#
# Everything is installed into .venv: run .venv/bin/python, .venv/bin/torchrun, or `source .venv/bin/activate`.
#
# The first run creates .venv and installs torch 2.13.0 only when no torch is importable there: the CPU
# build where no NVIDIA GPU is visible (torch==2.13.0+cpu from the configured index, else from
# download.pytorch.org's CPU index; TORCH_CUDA=1 asks for the CUDA build), the CUDA build where one is.
# The CUDA kernels are compiled only against a CUDA torch (DECENTPY_BUILD_CUDA=1: against any).
# Later runs do nothing unless csrc/, setup.py or pyproject.toml changed, in which case the extension
# is rebuilt.

SHELL := /bin/bash
.DEFAULT_GOAL := build

PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
PIP_Q   ?= -q
WORKERS ?= 4
ARGS    ?=
BENCH_ARGS ?=
TORCH_VERSION ?= 2.13.0
DECENT_DP_VERSION ?= 0.2.3
FAIRSCALE_VERSION ?= 0.4.13
LIGHTNING_VERSION ?= 2.6.6
NPROC   := $(shell nproc 2>/dev/null || echo 2)
CMAKE   := $(shell command -v cmake 2>/dev/null)
CMAKE_BUILD_DIR := build/cmake

DEPS_STAMP  := $(VENV)/.deps-stamp
BENCH_DEPS_STAMP := $(VENV)/.bench-deps-stamp
DOCS_DEPS_STAMP := $(VENV)/.docs-deps-stamp
BUILD_STAMP := $(VENV)/.build-stamp
EXT_INPUTS  := $(shell find csrc -type f 2>/dev/null) $(wildcard setup.py pyproject.toml)

.PHONY: build deps docs-deps docs wheel train test ctest pytest bench clean distclean help

# The header of this file, without its comment marks.
help:
	@sed -n '1,/^$$/p' $(firstword $(MAKEFILE_LIST)) | sed -e 's/^# \{0,1\}//'


build: $(BUILD_STAMP) $(BENCH_DEPS_STAMP)
deps: $(DEPS_STAMP) $(BENCH_DEPS_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# Order-only on the interpreter: its mtime must not trigger reinstalls. decent-dp is the reference
# that the drop-in tests and bench-train compare with (pure Python, needs loguru); --no-deps: it
# depends on an unpinned torch, which must not be replaced.
$(DEPS_STAMP): | $(PY)
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "torch $$($(PY) -c 'import torch; print(torch.__version__)') already in $(VENV)"; \
	elif [[ "$(TORCH_CUDA)" != 1 ]] && ! command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "no NVIDIA GPU here: installing the CPU build of torch $(TORCH_VERSION) into $(VENV) (about 200 MB;" \
	       "TORCH_CUDA=1 installs the CUDA one)"; \
	  $(PIP) install $(PIP_Q) "torch==$(TORCH_VERSION)+cpu" 2>/dev/null || \
	  $(PIP) install $(PIP_Q) --index-url https://download.pytorch.org/whl/cpu "torch==$(TORCH_VERSION)" || \
	  { echo "no CPU build of torch $(TORCH_VERSION) in the configured index or download.pytorch.org;" \
	         "installing torch==$(TORCH_VERSION) as the index serves it"; $(PIP) install $(PIP_Q) "torch==$(TORCH_VERSION)"; }; \
	else \
	  echo "installing torch==$(TORCH_VERSION) (the CUDA build: 1 GB or more with its CUDA libraries) into $(VENV)"; \
	  $(PIP) install $(PIP_Q) "torch==$(TORCH_VERSION)"; \
	fi
	$(PIP) install $(PIP_Q) numpy pytest pytest-timeout scikit-learn ninja pybind11 setuptools wheel tensorboard tqdm
	$(PIP) install $(PIP_Q) --no-deps "decent-dp==$(DECENT_DP_VERSION)" loguru
	@touch $@

# tensorboard (above) is what examples/train_lm.py --tensorboard writes for, tqdm its progress bar.
# scipy is for the bench only (the runtime model's calibration, tools/runtime_model/fit.py), which the
# tests import; python-etcd is the client torch's EtcdStore is written for (the elastic tests with an
# etcd rendezvous; they skip where the etcd server itself is not installed). PyTorch Lightning is what
# decentpy.integrations.lightning is tested against (an optional dependency of decentpy; --no-deps:
# it depends on an unpinned torch). Its own stamp: a venv made before it gets these without
# rebuilding the extension.
$(BENCH_DEPS_STAMP): $(DEPS_STAMP)
	$(PIP) install $(PIP_Q) scipy python-etcd
	$(PIP) install $(PIP_Q) --no-deps "pytorch-lightning==$(LIGHTNING_VERSION)" "lightning-utilities==0.15.3" \
	  "torchmetrics==1.9.0"
	$(PIP) install $(PIP_Q) tqdm pyyaml fsspec packaging typing-extensions
	@touch $@

# The docs' tools (Sphinx, MyST, furo, matplotlib for the topology pictures); none pulls torch. Its own
# stamp, redone when docs/requirements.txt changes.
docs-deps: $(DOCS_DEPS_STAMP)
$(DOCS_DEPS_STAMP): $(DEPS_STAMP) docs/requirements.txt
	$(PIP) install $(PIP_Q) -r docs/requirements.txt
	@touch $@

# The site, from a fresh clone: warnings are errors (-W), all of them reported (--keep-going). conf.py
# imports decentpy (autodoc, the topology pictures), hence the build; -E: no stale pages.
docs: $(BUILD_STAMP) $(DOCS_DEPS_STAMP)
	$(PY) -m sphinx -b html -W --keep-going -E -q docs docs/_build/html
	@echo "docs: $(abspath docs/_build/html/index.html)"

# --no-build-isolation: build against the torch installed above, never a freshly pulled one.
# The compiler's progress ([done/total] per source) is shown; the whole log stays in $(VENV)/build.log.
$(BUILD_STAMP): $(DEPS_STAMP) $(EXT_INPUTS)
	@echo "building decentpy (compiles decentpy._C: a few minutes the first time, then only what changed)"
	@$(PIP) install -v --no-build-isolation -e . 2>&1 | tee $(VENV)/build.log | \
	  grep --line-buffered -E '^ *\[[0-9]+/[0-9]+\] |^decentpy: ' | cut -c1-150; \
	  status=$${PIPESTATUS[0]}; if [[ $$status -ne 0 ]]; then \
	    tail -n 40 $(VENV)/build.log; echo "the build failed; its whole log: $(VENV)/build.log"; exit $$status; fi
	@touch $@

# Wheel of the extension built against the torch in $(VENV) (it requires that torch major.minor).
# Builds in-tree: build/temp.* is shared with `make build`, so an unchanged tree only relinks.
WHEEL_DIR ?= dist
wheel: $(DEPS_STAMP)
	@mkdir -p $(WHEEL_DIR)
	DECENTPY_WHEEL=1 $(PIP) wheel $(PIP_Q) --no-build-isolation --no-deps -w $(WHEEL_DIR) .
	@echo "wheel: $$(ls -t $(WHEEL_DIR)/decentpy-*.whl | head -n 1)"

train: $(BUILD_STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=$(WORKERS) examples/train_digits.py $(ARGS)

test: ctest pytest

pytest: $(BUILD_STAMP) $(BENCH_DEPS_STAMP)
	$(PY) -m pytest -q --durations=15 tests

ctest: $(BUILD_STAMP)
ifeq ($(CMAKE),)
	@echo "cmake not found: skipping the C++ tests (ctest)"
else
	@if [[ ! -f CMakeLists.txt ]]; then echo "no CMakeLists.txt: skipping the C++ tests (ctest)"; exit 0; fi; \
	set -e; mkdir -p $(CMAKE_BUILD_DIR); \
	prefix="$$($(PY) -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"; \
	cmake -S . -B $(CMAKE_BUILD_DIR) -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_PREFIX_PATH="$$prefix" -DPython_EXECUTABLE="$(abspath $(PY))" > $(CMAKE_BUILD_DIR)/configure.log 2>&1 \
	  || { cat $(CMAKE_BUILD_DIR)/configure.log; exit 1; }; \
	MAKEFLAGS= MFLAGS= MAKELEVEL= cmake --build $(CMAKE_BUILD_DIR) -j $(NPROC); \
	cd $(CMAKE_BUILD_DIR) && ctest --output-on-failure
endif

# The benchmarks and tools run as modules from the repository root (python -m bench.bench_train, python -m
# tools.runtime_model): they import bench.common and tools by their package names.
bench: $(BUILD_STAMP)
	$(PY) -m bench.bench_kernels $(BENCH_ARGS)

# matplotlib is installed for the benchmark plots only (decent-dp and scipy come with `make deps`).
.PHONY: bench-outer bench-straggler bench-train bench-shard bench-fairscale-parity bench-pipe bench-hybrid bench-convergence bench-faults bench-elastic bench-lm runtime-model
bench-outer: $(BUILD_STAMP)
	$(PIP) install $(PIP_Q) matplotlib
	$(PY) -m bench.bench_outer_step $(BENCH_ARGS)

bench-straggler: $(BUILD_STAMP) $(BENCH_DEPS_STAMP)
	$(PIP) install $(PIP_Q) matplotlib
	OMP_NUM_THREADS=1 $(PY) -m bench.bench_straggler $(BENCH_ARGS)

bench-train: $(BUILD_STAMP)
	$(PIP) install $(PIP_Q) matplotlib
	OMP_NUM_THREADS=1 $(PY) -m bench.bench_train $(BENCH_ARGS)

# fairscale is the reference of the sharding benchmark only; --no-deps: it depends on an unpinned
# torch, which would replace the CPU torch of $(VENV) with CUDA wheels.
bench-shard: $(BUILD_STAMP)
	$(PIP) install $(PIP_Q) --no-deps "fairscale==$(FAIRSCALE_VERSION)"
	OMP_NUM_THREADS=1 $(PY) -m bench.bench_shard $(BENCH_ARGS)

# Does a fairscale script train the same with decentpy? fairscale (--no-deps, as above) is the reference.
bench-fairscale-parity: $(BUILD_STAMP)
	$(PIP) install $(PIP_Q) --no-deps "fairscale==$(FAIRSCALE_VERSION)"
	$(PIP) install $(PIP_Q) matplotlib
	OMP_NUM_THREADS=1 $(PY) -m bench.bench_fairscale_parity $(BENCH_ARGS)

bench-pipe: $(BUILD_STAMP)
	$(PIP) install $(PIP_Q) matplotlib
	OMP_NUM_THREADS=1 $(PY) -m bench.bench_pipe $(BENCH_ARGS)

bench-hybrid: $(BUILD_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m bench.bench_hybrid $(BENCH_ARGS)

bench-convergence: $(BUILD_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m bench.bench_convergence $(BENCH_ARGS)

bench-faults: $(BUILD_STAMP)
	$(PIP) install $(PIP_Q) matplotlib
	OMP_NUM_THREADS=1 $(PY) -m bench.bench_faults $(BENCH_ARGS)

bench-elastic: $(BUILD_STAMP)
	$(PIP) install $(PIP_Q) matplotlib
	OMP_NUM_THREADS=1 $(PY) -m bench.bench_elastic $(BENCH_ARGS)

bench-lm: $(BUILD_STAMP) $(BENCH_DEPS_STAMP)
	$(PIP) install $(PIP_Q) matplotlib
	OMP_NUM_THREADS=1 $(PY) -m bench.bench_lm $(if $(strip $(BENCH_ARGS)),$(BENCH_ARGS),--race)

runtime-model: $(BUILD_STAMP) $(BENCH_DEPS_STAMP)
	$(PIP) install $(PIP_Q) matplotlib
	$(PY) -m tools.runtime_model $(BENCH_ARGS)

clean:
	rm -rf build dist *.egg-info .pytest_cache bench/out docs/_build docs/_generated $(BUILD_STAMP)
	rm -f decentpy/_C*.so decentpy/_C*.pyd
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
