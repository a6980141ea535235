# The two commands a fresh machine needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install clean proto

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first and pinned to a CPU-capable build: a bare `torch` requirement pulls several GB of CUDA.
TORCH_SPEC ?= torch==2.13.0

# The native decoder is compiled by the editable install: rebuild when its source changes.
$(STAMP): $(BIN)/python pyproject.toml engine/compression/native_decoder.c engine/cpu_attention.c engine/cpu_matmul.c engine/cpu_buffers.h
	$(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/pip install -q '$(TORCH_SPEC)'
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The whole system on this machine: registry, three sites (prefill-only, decode-only, both) and a
# router on 127.0.0.1:8080, on a random-weight demo model made under .edgefire/ on first run.
# Ctrl-C stops it. Pass options with UP_ARGS, e.g. `make run UP_ARGS="--sites 4 --model DIR"`.
run: $(STAMP)
	$(BIN)/edgefire up $(UP_ARGS)

# The suite runs on TEST_WORKERS pytest-xdist workers: many tests wait on processes and sockets, so more
# workers than cores pays. Each test file stays on one worker; the end-to-end files share one (tests/conftest.py).
TEST_WORKERS ?= 3

# Bytecode caches on for the run even where the environment turns them off (PYTHONDONTWRITEBYTECODE): the suite starts
# hundreds of agents, routers, registries and CLI calls, and each compiled the project's sources afresh without them.
test: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

# Regenerate the agent gRPC stubs after editing node_agent/proto/agent.proto.
proto: $(STAMP)
	cd node_agent/proto && ../../$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. agent.proto
	sed -i 's/^import agent_pb2 as agent__pb2/from node_agent.proto import agent_pb2 as agent__pb2/' node_agent/proto/agent_pb2_grpc.py
