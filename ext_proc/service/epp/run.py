"""`gorgo epp`: the router as a Gateway API Inference Extension endpoint picker, started as
the extension's `inferencepool` chart starts its own (flags.py reads its flags):
ext_proc over TLS on 9002 (a self-signed certificate unless --cert-path, as the chart's
Envoy expects: it does not verify the picker), the standard gRPC health service on 9003
(what the chart's probes ask), Prometheus /metrics (and the admin API) on 9090, and the
backends found from the InferencePool's pods through the Kubernetes API.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import signal
import socket
import sys
from pathlib import Path

import grpc
import orjson

from ext_proc.config.load import config_from_dict
from ext_proc.config.schema import Config
from ext_proc.service.epp.flags import EppOptions, config_dict
from ext_proc.vocab.params import ConfigError

log = logging.getLogger("gorgo.epp")

# The self-signed certificate: valid this long (the pod restarts long before).
SELF_SIGNED_DAYS = 365


def self_signed_pem(host: str = "") -> tuple[bytes, bytes]:
    """A new key and a certificate for it, signed by itself (PEM), naming this host, its
    pod's name and IP when it has one, and localhost."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gorgo-epp")])
    host = host or socket.gethostname()
    alt: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.DNSName(host)]
    for ip in ("127.0.0.1", "::1"):
        alt.append(x509.IPAddress(ipaddress.ip_address(ip)))
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def credentials(opts: EppOptions) -> tuple[grpc.ServerCredentials | None, str]:
    """The ext_proc port's TLS and how it was made (for the ready line)."""
    if not opts.secure_serving:
        return None, "plaintext"
    if opts.cert_path:
        d = Path(opts.cert_path)
        try:
            key, cert = (d / "tls.key").read_bytes(), (d / "tls.crt").read_bytes()
        except OSError as e:
            raise ConfigError(f"--cert-path: {e.filename}: {e.strerror}") from e
        return grpc.ssl_server_credentials([(key, cert)]), f"TLS ({d})"
    key, cert = self_signed_pem()
    return grpc.ssl_server_credentials([(key, cert)]), "TLS (self-signed)"


class JsonLogFormatter(logging.Formatter):
    """One JSON object a line (--zap-encoder json), the keys zap writes."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["stacktrace"] = self.formatException(record.exc_info)
        return orjson.dumps(doc).decode()


def setup_logging(opts: EppOptions) -> None:
    """The chart's -v and --zap-encoder: verbosity 3 and up is debug."""
    handler = logging.StreamHandler()
    if opts.zap_encoder == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if opts.verbosity >= 3 else logging.INFO)


def epp_config(opts: EppOptions) -> Config:
    return config_from_dict(config_dict(opts))


def run(opts: EppOptions) -> int:
    setup_logging(opts)
    for flag in opts.ignored:
        log.warning("gorgo epp: %s has no meaning here: ignored", flag)
    try:
        cfg = epp_config(opts)
        creds, tls = credentials(opts)
    except ConfigError as e:
        print(f"gorgo epp: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(cfg, opts, creds, tls))
    except OSError as e:
        print(f"gorgo epp: {e}", file=sys.stderr)
        return 1
    return 0


async def _serve(
    cfg: Config, opts: EppOptions, creds: grpc.ServerCredentials | None, tls: str
) -> None:
    from ext_proc.service.app import running_service

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with running_service(cfg, grpc_credentials=creds) as svc:
        # The chart's probes ask the health service on a port of its own, in plaintext
        # (Kubernetes' gRPC probes speak no TLS): the same service, a second server.
        health_server = grpc.aio.server()
        assert svc.health is not None
        svc.health.attach(health_server)
        address = f"{opts.address}:{opts.grpc_health_port}"
        health_port = health_server.add_insecure_port(address)
        if opts.grpc_health_port and health_port != opts.grpc_health_port:
            raise OSError(f"--grpc-health-port: cannot bind {address} (port in use?)")
        await health_server.start()
        k8s = cfg.discovery.kubernetes
        source = (
            f"InferencePool {k8s.pool_name}"
            if k8s.pool_name
            else f"pods {k8s.endpoint_selector} ports {list(k8s.target_ports)}"
        )
        print(
            f"gorgo epp: ready. ext_proc gRPC {tls} on {opts.address}:{svc.grpc_port}, "
            f"gRPC health on {opts.address}:{health_port}, metrics "
            f"http://{opts.address}:{svc.admin_port}/metrics, backends from {source}, "
            f"policy {cfg.policy}",
            flush=True,
        )
        try:
            await stop.wait()
        finally:
            await health_server.stop(0.5)
