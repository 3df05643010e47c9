"""The ext_proc codec (ext_proc/envoy/codec.py): any bytes as a ProcessingRequest.

Invariant: bytes that are not a ProcessingRequest raise protobuf's DecodeError; every
message that is one decodes (its phase, headers, body, picker metadata, stream settings
and attributes) without an exception, and what it says is well-formed."""

from __future__ import annotations

import atheris

with atheris.instrument_imports(include=["ext_proc"]):
    from google.protobuf.message import DecodeError

    from ext_proc.envoy import codec

from tests.fuzz.runner import fuzz

NAME = "codec"


def one_input(data: bytes) -> None:
    try:
        req = codec.ProcessingRequest.FromString(data)
    except DecodeError:
        return
    phase = codec.decode(req)
    assert phase.name in (*codec.PHASES, "")
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in phase.headers.items())
    assert isinstance(phase.body, bytes)
    assert phase.subset is None or all(phase.subset)
    info = codec.stream_info(req)
    assert info.observe_only == req.observability_mode
    assert isinstance(codec.request_id_attribute(req), str)
    code, details = codec.response_status_attributes(req)
    assert code == 0 or 100 <= code <= 599, code
    assert isinstance(details, str)


def main() -> None:
    fuzz(NAME, one_input)


if __name__ == "__main__":
    main()
