# The README's commands. Heavy caches live outside the clone, keyed by version.
export CARGO_TARGET_DIR ?= $(HOME)/.cache/switchboard/target
CARGO ?= cargo

.PHONY: demo test deps build lint unit bench

## make demo: the whole pipeline locally (ephemeral PostgreSQL + Redis, 20,000 messages, a kill -9 mid-way)
demo: deps build
	$(CARGO) run --quiet -p switchboard-tests --bin switchboard-demo

## make test: formatting, lints and every test against real servers
test: deps lint build
	$(CARGO) test --workspace

deps:
	scripts/install-deps.sh

build:
	$(CARGO) build --workspace --bins

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
