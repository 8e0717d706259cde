# moeguard: run `make help` for the targets.
SHELL := /bin/bash
PY := .venv/bin/python
export PYTHONPATH := $(CURDIR)/operator:$(CURDIR)/runtime:$(CURDIR)/core:$(CURDIR)
export MOEGUARD_RUN_DIR ?= /tmp/moeguard-run
# make test-cluster: pytest-xdist workers, each with its own local cluster (tests/suite_setup.py); whole
# files per worker (module-scoped operators and workers stay together), in the suite's order (the integration files
# by their times in tests/file_seconds.json, longest first within the CPU-bound and the clock-bound kind, merged:
# tests/suite_setup.py integration_order), not xdist's default of the files
# with the most tests first, which left the one-test 4.5-min diagnosis drill for the end. Refresh the times with
# MOEGUARD_PYTEST_ARGS=--store-file-seconds=$$PWD/tests/file_seconds.json .ci/run (merged into the file). Four workers on 2 cores: once a worker started in 3.2 s of CPU
# instead of 5.8 and the tests' kubectl reads went through one API client, the e2e phase left the CPUs half idle;
# a fourth worker took the xdist part from 22 min 34 s (-n 3) to 20 min 02 s and 22 min 55 s, all passed (clean-clone
# rehearsals Q, R and S, 2026-12-06, AMD EPYC; docs/testing.md). Before those two fixes -n 4 was slower (rehearsal P, stopped).
# XDIST="-n 0": one process.
XDIST ?= -n 4 --dist loadfile --no-loadscope-reorder
# the 25 slowest tests, then the time per part (tests/conftest.py)
DURATIONS ?= --durations=25

.DEFAULT_GOAL := help

.PHONY: help
help: ## Show this help.
	@awk 'BEGIN {FS = ":.*?## "} /^[a-zA-Z_-]+:.*?## / {printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: deps
deps: ## Install Debian packages, the Python venv and the Go-built control plane (cached).
	hack/install-deps.sh

.PHONY: all-deps
all-deps: ## deps and node-deps at once: one apt-get call, the venv downloading while Go builds (what `make test` runs).
	hack/install-deps.sh --node

.PHONY: demo
demo: deps ## The main job end to end: control plane, Prometheus, operator, workers, real traffic, closed loop.
	$(PY) hack/demo.py $(DEMO_ARGS)

.PHONY: test
test: all-deps ## All tests: test-cluster, then test-node (root; hack/test-all.sh times each).
	hack/test-all.sh

.PHONY: test-cluster run-test-cluster
test-cluster: deps run-test-cluster ## Unit, then integration against the real local control plane and Prometheus (no real node: no root needed).
# Then the tests marked `alone` (the six diagnosis drills at once), in one process with nothing beside them:
# beside two other xdist workers' clusters their findings came late or wrong (CI of stops 38 and 39: the load
# average past 11), alone they pass (bench/diagnosis.md: 18/18). Both parts run; pytest's 5 (none selected,
# e.g. under a PYTEST_ARGS -k) is not a failure.
run-test-cluster:
	@rc=0; \
	$(PY) -m pytest tests -m "(unit or integration) and not alone" $(XDIST) $(DURATIONS) $(PYTEST_ARGS) || \
	  { r=$$?; [ $$r -eq 5 ] || rc=$$r; }; \
	$(PY) -m pytest tests -m "integration and alone" $(DURATIONS) $(PYTEST_ARGS) || { r=$$?; [ $$r -eq 5 ] || rc=$$r; }; \
	exit $$rc

.PHONY: test-unit
test-unit: deps ## Unit tests only (no processes, no network).
	$(PY) -m pytest tests -m unit $(PYTEST_ARGS)

.PHONY: manifests
manifests: ## Regenerate crds/, the chart's CRD template, the dashboard and the generated docs from the models.
	$(PY) -m moeguard_operator.spec.crdgen
	$(PY) hack/generate.py

.PHONY: lint
lint: ## ruff and mypy --strict.
	$(PY) -m ruff check operator runtime core tests bench hack harness
	$(PY) -m mypy

.PHONY: cluster-up
cluster-up: deps ## Start etcd, kube-apiserver, controller-manager, scheduler, kwok (2 fake GPU nodes) and Prometheus; NODE=1: and the real node.
	hack/cluster-up.sh
	@if [ "$${NODE:-0}" = 1 ]; then hack/install-node-deps.sh && hack/node-up.sh; fi

.PHONY: cluster-down
cluster-down: ## Stop the local control plane and Prometheus.
	hack/cluster-down.sh

.PHONY: node-deps
node-deps: ## Install what the real node and the image builds need (Debian: containerd, runc, CNI, buildah, mmdebstrap; Go: kubelet, crictl).
	hack/install-node-deps.sh

.PHONY: node-up
node-up: deps node-deps ## Start the real node (containerd, a kubelet of the pinned version, the GPU device plugin) in the local cluster.
	hack/cluster-up.sh
	hack/node-up.sh

.PHONY: node-down
node-down: ## Stop the real node (the control plane keeps running; cluster-down stops both).
	hack/node-down.sh

.PHONY: images
images: node-deps ## Build the operator and worker images with buildah on a local Debian base (cached by the hash of their inputs).
	hack/build-images.sh operator worker

.PHONY: test-node run-test-node
test-node: deps node-deps run-test-node ## e2e on the real node: the images built and loaded, the operator's worker pod serving (tests/node; part of `make test`; root).
run-test-node:
	hack/cluster-up.sh
	hack/node-up.sh
	hack/build-images.sh --load operator worker >$(MOEGUARD_RUN_DIR)/node/images.env
	MOEGUARD_TEST_NODE=1 $(PY) -m pytest tests/node -m node $(DURATIONS) $(PYTEST_ARGS)

.PHONY: operator
operator: ## Run the operator against KUBECONFIG (default: the local control plane).
	KUBECONFIG=$${KUBECONFIG:-$(MOEGUARD_RUN_DIR)/kubeconfig} $(PY) -m moeguard_operator -A --standalone --prometheus-url http://127.0.0.1:$$((19090 + $${MOEGUARD_PORT_OFFSET:-0}))

.PHONY: lock
lock: ## Re-resolve requirements.in into the pinned requirements.txt.
	python3 -m venv /tmp/moeguard-lock && /tmp/moeguard-lock/bin/pip install -q --dry-run --report /tmp/moeguard-lock.json -r requirements.in
	{ head -2 requirements.txt; python3 -c "import json; r=json.load(open('/tmp/moeguard-lock.json')); print('\n'.join(sorted(f\"{i['metadata']['name']}=={i['metadata']['version']}\" for i in r['install'])))"; } > requirements.lock.tmp && mv requirements.lock.tmp requirements.txt

.PHONY: generate
generate: ## Regenerate the chart's CRD template, the Grafana dashboard, docs/crd-reference.md and docs/metrics.md.
	$(PY) hack/generate.py

.PHONY: chart-lint
chart-lint: ## helm lint the chart (strict).
	PATH=$$HOME/.cache/moeguard/bin/helm-$$(grep ^HELM_VERSION hack/versions.env | cut -d= -f2):$$PATH helm lint charts/moeguard --strict --kube-version 1.34.4

.PHONY: test-delivery
test-delivery: deps ## Chart, GitOps, image, CLI and docs tests (unit, then against the local control plane).
	$(PY) -m pytest tests/unit/delivery tests/integration/delivery $(PYTEST_ARGS)

.PHONY: bench-runtime
bench-runtime: ## Runtime benchmarks (MoE layer vs HF loop, decode vs bandwidth, loop overhead) -> bench/results/runtime.md.
	$(PY) -m bench.runtime_bench

.PHONY: bench-structured
bench-structured: ## Structured outputs: TPOT at batch 8 with and without a JSON schema, 20-field schema compile time -> bench/results/structured_output.md (~2 min).
	$(PY) -m bench.structured_output_bench

.PHONY: bench-ep
bench-ep: ## Expert parallelism: per-step compute vs collectives and bytes for 1, 2, 4 local ranks, DeepEP on paper -> bench/results/expert_parallel.md.
	$(PY) -m bench.expert_parallel_bench

.PHONY: bench-soak
bench-soak: ## C6 at full length: 10 minutes of steady traffic, RSS slope -> bench/results/soak.md.
	$(PY) -m bench.soak --minutes 10

.PHONY: bench-memory-model
bench-memory-model: ## Memory model vs measured step peaks (32 preset + 25 HF-family + 16 serving-chunk configs, fresh process each) -> bench/results/memory_model.md.
	$(PY) -m bench.memory_run
	$(PY) -m bench.memory_validate

.PHONY: bench-memory-families
bench-memory-families: ## The same, re-measuring only the HF families' 25 configurations (keeps the others' rows).
	$(PY) -m bench.memory_run --families
	$(PY) -m bench.memory_validate

.PHONY: bench-memory-serving
bench-memory-serving: ## The same, re-measuring only the 16 chunked-prefill serving rows (one probe at a time; keeps the others' rows).
	$(PY) -m bench.memory_run --serving-chunks --jobs 1
	$(PY) -m bench.memory_validate

.PHONY: bench-ucx-leak
bench-ucx-leak: ## The UCX leak trial: NIXL's UCX (two wheels, UCX 1.20 and 1.23) moving KV blocks between two processes, RSS slopes under UCX's defaults and moeguard's cures, 3 reps -> bench/results/ucx_leak.md (~17 min; installs the wheels under ~/.cache/moeguard/nixl).
	$(PY) -m bench.ucx_leak --reps 3

.PHONY: bench-headline
bench-headline: deps ## Headline, 4 arms (request-count, static budgets, inner loop, operator in the loop), 2 replicas, trace + skew + leak, 3 reps -> bench/RESULTS.md (~25 min).
	$(PY) -m bench.headline_loop --reps 3 $(BENCH_ARGS)
	$(PY) -m bench.headline_loop_report

.PHONY: bench-headline-workers
bench-headline-workers: ## The earlier headline: one worker process, 3 policies, no control plane -> bench/results/headline/ (raw runs only).
	$(PY) -m bench.headline --reps 3

.PHONY: bench-scale
bench-scale: deps ## The operator with 1, 200 and 1,000 services (kwok pods, no workers): Ready time, RSS, idle API writes, Prometheus queries -> bench/results/operator_scale.md (~25 min).
	$(PY) -m bench.operator_scale $(SCALE_ARGS)

.PHONY: bench-families
bench-families: ## Per family (mixtral, qwen2_moe, qwen3_moe, deepseek_v3, olmoe): prefill, decode and peak memory vs transformers, same weights -> bench/results/families.md (~10 min).
	$(PY) -m bench.families_bench

.PHONY: bench-refusal
bench-refusal: ## Refusal cost: a normal client's goodput alone vs beside ~100 refused requests/s that ignore Retry-After, interleaved windows -> bench/results/refusal_cost.md (~5 min).
	$(PY) -m bench.refusal_cost $(BENCH_ARGS)

.PHONY: bench-diagnosis
bench-diagnosis: deps ## Diagnosis drills on the local control plane: 3 drills per finding kind and a 10-min calm trace run -> bench/diagnosis.md (~30 min).
	$(PY) -m bench.diagnosis $(BENCH_ARGS)

.PHONY: bench-control
bench-control: deps ## Control latency on the local control plane: skew step x10, recovery, OOM kill -> bench/results/control_latency.md (~25 min).
	$(PY) -m bench.control_latency $(BENCH_ARGS)

.PHONY: bench-control-predictive
bench-control-predictive: deps ## Control latency, operator --policy predictive (issue 30): skew with room x3, a step that would not fit x5, OOM kill x3 -> bench/results/control_latency_predictive.md (~15 min).
	$(PY) -m bench.control_latency --policy predictive $(BENCH_ARGS)

.PHONY: bench-priority
bench-priority: ## Interactive first: interactive p95 at 2x capacity (50/50 with batch) vs unloaded, priority vs fcfs, 3 reps -> bench/results/priority.md (~7 min).
	$(PY) -m bench.priority --reps 3 $(BENCH_ARGS)

.PHONY: bench-pd
bench-pd: ## Disaggregated prefill/decode on 2 cores (issue 33): one worker vs a prefill + decode pair, the headline's trace (a shorter window), 3 reps interleaved: TTFT/TPOT p50/p99, SLO goodput, KV transfer ms and bytes per request, outputs compared -> bench/results/pd.md (~8 min).
	$(PY) -m bench.pd_bench --reps 3 $(BENCH_ARGS)
