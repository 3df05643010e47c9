# GORGO images, two targets from one file:
#   router (default): `gorgo serve` and `gorgo envoy-config` only; the router package and
#     its runtime dependencies, nothing of the emulator, the load generator or their
#     plotting.
#   epp: the router as the Gateway API Inference Extension's endpoint picker: entrypoint
#     `gorgo epp`, so the extension's inferencepool chart, which passes its picker only
#     arguments (--pool-name ...), runs it as its own (deploy/k8s/README.md).
#   full: the same CLI plus the harness subcommands that docker-compose.yml runs for the
#     emulated engines (`gorgo engine`), WAN links (`gorgo wan`) and the load generator
#     (`gorgo replay`), with the `harness` extra.
#
#   docker build -t gorgo-router .                      # the router
#   docker build --target full -t gorgo-full .          # router + harness
#   docker build --target epp -t gorgo-epp .            # the chart's endpoint picker
#   docker run --rm -v $PWD/config/compose/gorgo.yaml:/etc/gorgo/gorgo.yaml:ro gorgo-router
#
# The build stages install into a virtual environment; the final stages copy that
# environment, so no pip cache ships. The protobuf module is committed (make proto), so
# nothing is compiled.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build-router
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Versions pinned by constraints.txt, as `make venv` does.
COPY pyproject.toml constraints.txt README.md LICENSE ./
COPY ext_proc ext_proc
RUN python -m venv /opt/gorgo \
    && /opt/gorgo/bin/pip install -c constraints.txt . \
    && cd / && /opt/gorgo/bin/gorgo --version && /opt/gorgo/bin/python -c 'import ext_proc.envoy.server'

FROM build-router AS build-full
COPY emulator emulator
COPY loadgen loadgen
RUN /opt/gorgo/bin/pip install -c constraints.txt '.[harness]' \
    && cd / && /opt/gorgo/bin/gorgo engine --help > /dev/null

# What both images run on: an unprivileged user with a home (tokenizers and matplotlib
# write caches there), the environment's bin on PATH.
FROM ${PYTHON_IMAGE} AS runtime
ENV PATH=/opt/gorgo/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
RUN useradd --create-home --uid 10001 --user-group gorgo
USER gorgo
WORKDIR /home/gorgo
ENTRYPOINT ["gorgo"]

FROM runtime AS full
LABEL org.opencontainers.image.title="gorgo-full" \
      org.opencontainers.image.description="GORGO router with its emulated fleet and load generator" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build-full /opt/gorgo /opt/gorgo

FROM runtime AS epp
LABEL org.opencontainers.image.title="gorgo-epp" \
      org.opencontainers.image.description="GORGO as a Gateway API Inference Extension endpoint picker" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build-router /opt/gorgo /opt/gorgo
# The chart's ports: ext_proc (TLS), gRPC health, /metrics.
EXPOSE 9002 9003 9090
ENTRYPOINT ["gorgo", "epp"]

# Last, so that a plain `docker build` makes the router image.
FROM runtime AS router
LABEL org.opencontainers.image.title="gorgo-router" \
      org.opencontainers.image.description="Envoy ext_proc routing extension for LLM fleets (GORGO)" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build-router /opt/gorgo /opt/gorgo
# ext_proc + access-log gRPC, admin HTTP (/healthz, /metrics, /state).
EXPOSE 50051 9180
CMD ["serve", "--config", "/etc/gorgo/gorgo.yaml"]
