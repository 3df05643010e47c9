# GORGO image: `gorgo serve` (the ext_proc service), and the same CLI for the emulated
# engines (`gorgo engine`), WAN links (`gorgo wan`) and the load generator (`gorgo replay`)
# that docker-compose.yml runs.
#
#   docker build -t gorgo-router .
#   docker run --rm -v $PWD/config/compose/gorgo.yaml:/etc/gorgo/gorgo.yaml:ro gorgo-router
#
# Two stages: the build stage compiles the protobuf classes (grpcio-tools is a build tool
# only) and installs the project into a virtual environment; the final stage copies that
# environment, so no compiler, pip cache or grpcio-tools ships.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Versions pinned by constraints.txt, as `make venv` does. The protoc venv layer is reused
# until the pins change.
COPY pyproject.toml constraints.txt ./
RUN python -m venv /opt/protoc \
    && /opt/protoc/bin/pip install -c constraints.txt grpcio-tools \
    && python -m venv /opt/gorgo
COPY README.md LICENSE ./
COPY ext_proc ext_proc
COPY emulator emulator
COPY loadgen loadgen
# Protobuf classes generated at build time, exactly as the Makefile's `proto` target does
# (the repository holds only our own .proto; the generated files are never committed).
RUN /opt/protoc/bin/python -m grpc_tools.protoc -Iext_proc/proto --python_out=ext_proc/proto \
        --pyi_out=ext_proc/proto ext_proc/proto/envoy_wire.proto \
    && /opt/gorgo/bin/pip install -c constraints.txt . \
    && cd / && /opt/gorgo/bin/python -c "import ext_proc.proto.envoy_wire_pb2, ext_proc.cli"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gorgo-router" \
      org.opencontainers.image.description="Envoy ext_proc routing extension for LLM fleets (GORGO)" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/gorgo/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY --from=build /opt/gorgo /opt/gorgo
# Unprivileged user with a home (matplotlib and tokenizers write caches there).
RUN useradd --create-home --uid 10001 --user-group gorgo
USER gorgo
WORKDIR /home/gorgo
# ext_proc + access-log gRPC, admin HTTP (/healthz, /metrics, /state).
EXPOSE 50051 9180
ENTRYPOINT ["gorgo"]
CMD ["serve", "--config", "/etc/gorgo/gorgo.yaml"]
