"""What a look at the fleet (probes.py) means for the router, judged as the router will
read each backend: its prefix state from the engine's KV events or the router's own
estimate, its tokens the engine's or approximated, its queue from the engine's /metrics or
estimated (each of those: aspects.py); what it serves against the config, the fleet's
models and tokenizer; and every problem, each with a fix that names the key or flag to
change. Pure: a look in, a verdict (verdict.py) out.
"""

from __future__ import annotations

import statistics
from collections import Counter

from ext_proc.config.schema import Config
from ext_proc.service.check.aspects import (
    prefix_aspect,
    priority_aspect,
    queue_aspect,
    rtt_problems,
    tokens_aspect,
)
from ext_proc.service.check.probes import BackendLook, Look
from ext_proc.service.check.verdict import BackendVerdict, ModelVerdict, Problem, Verdict


def judge_backend(look: BackendLook, fleet: Look, cfg: Config, out: Verdict) -> BackendVerdict:
    b, key = look.backend, f"backends[{look.index}]"
    where = f"backend {b.id}"
    if look.unreachable and not look.rtt_ms:
        out.problems.append(
            Problem(
                where,
                f"http://{b.address}/v1/models: {look.unreachable}",
                f"start its engine, or correct {key}.address (its host:port as the router and "
                "Envoy reach it)",
            )
        )
    elif look.models_error and (cfg.probes.models_interval_s > 0 or b.kv_events.endpoint):
        out.problems.append(
            Problem(
                where,
                f"/v1/models: {look.models_error}",
                f"let the engine's /v1/models answer the router (it reads what each engine "
                f"serves there), or set probes.models_interval_s: 0 and list {key}.models",
            )
        )
    elif look.models_error:
        out.notes.append(f"{where}: /v1/models: {look.models_error} (the router does not read it)")
    if look.models is not None and b.models:
        missing = [m for m in b.models if not look.models.serves(m)]
        if missing:
            out.problems.append(
                Problem(
                    where,
                    f"{key}.models lists {', '.join(map(repr, missing))}, its engine serves "
                    f"{', '.join(map(repr, sorted(look.models.names)))}",
                    f"start its engine serving {missing[0]!r} (--served-model-name), or correct "
                    f"{key}.models",
                )
            )
    rtt_problems(look, cfg, out.problems, where)
    tokens = tokens_aspect(look, fleet, out, where)
    models = look.models.restricted_to(b.models) if look.models and b.models else look.models
    return BackendVerdict(
        b.id,
        b.address,
        str(b.engine),
        not look.unreachable,
        round(statistics.median(look.rtt_ms), 2) if look.rtt_ms else None,
        sorted(models.names) if models is not None else [],
        prefix_aspect(look, tokens, out, where),
        tokens,
        queue_aspect(look, cfg, out, where),
        priority_aspect(look, out, where),
    )


def _fleet_models(cfg: Config, fleet: Look, out: Verdict) -> None:
    """Models the config names that no backend serves; with none named, a backend that
    serves other models than the rest of the fleet."""
    answered = [look for look in fleet.backends if look.models is not None]
    if not answered:
        return
    served = {v.id: set(v.models) for v in out.backends}
    for j, alias in enumerate(cfg.models):
        for k, share in enumerate(alias.served):
            if not any(share.model in names for names in served.values()):
                out.problems.append(
                    Problem(
                        "fleet",
                        f"models[{j}] ({alias.name!r}) sends requests to {share.model!r}, which "
                        "no backend serves",
                        f"serve {share.model!r} on a backend, or correct "
                        f"models[{j}].served[{k}].model",
                    )
                )
    if cfg.models or any(b.models for b in cfg.backends):
        return
    bases = {look.backend.id: look.models.base for look in answered if look.models}
    counts = Counter(bases.values()).most_common()
    if len(counts) < 2:
        return
    if counts[0][1] > counts[1][1]:
        usual = counts[0][0]
        for backend, base in bases.items():
            if base != usual:
                out.problems.append(
                    Problem(
                        f"backend {backend}",
                        f"serves {', '.join(map(repr, sorted(base)))}, the other backends "
                        f"{', '.join(map(repr, sorted(usual)))}",
                        f"start its engine with {sorted(usual)[0]!r}, or, for a fleet of "
                        "several models, list each backend's in backends[].models",
                    )
                )
        return
    said = "; ".join(f"{b}: {', '.join(sorted(m))}" for b, m in sorted(bases.items()))
    out.problems.append(
        Problem(
            "fleet",
            f"the backends serve different models ({said})",
            "start every engine with the same model, or, for a fleet of several models, list "
            "each backend's in backends[].models",
        )
    )


def _per_model(out: Verdict) -> list[ModelVerdict]:
    names = sorted({m for v in out.backends for m in v.models})
    verdicts = []
    for name in names:
        on = [v for v in out.backends if name in v.models]
        verdicts.append(
            ModelVerdict(
                name,
                [v.id for v in on],
                [v.id for v in on if v.prefix.precise],
                [v.id for v in on if v.tokens.precise],
                [v.id for v in on if v.queue.precise],
            )
        )
    return verdicts


def judge(cfg: Config, fleet: Look) -> Verdict:
    t = fleet.tokenizer
    if t.source == "config":
        said = f"configured: {t.where}"
    elif t.source == "discovered":
        said = f"found {t.where}"
    else:
        said = f"none: 4 bytes per token ({t.not_found})"
    out = Verdict(said)
    for look in fleet.backends:
        out.backends.append(judge_backend(look, fleet, cfg, out))
    _fleet_models(cfg, fleet, out)
    out.models = _per_model(out)
    with_kv = [look for look in fleet.backends if look.backend.kv_events.endpoint]
    if t.engine is None and any(not look.unreachable for look in with_kv):
        served = next((look.served[0] for look in with_kv if look.served), "")
        model = f"the tokenizer.json {served!r} is served with" if served else "its tokenizer.json"
        out.problems.append(
            Problem(
                "tokenizer",
                f"the KV events of {', '.join(look.backend.id for look in with_kv)} need the "
                f"engine's tokens, and no tokenizer is at hand ({t.not_found})",
                f"set tokenizer.path to {model} (and tokenizer.chat_template unless the "
                "tokenizer_config.json beside it carries the template)",
            )
        )
    if t.engine is None and not with_kv:
        out.notes.append(
            "tokens are approximated (4 bytes per token): set tokenizer.path to the served "
            "model's tokenizer.json for exact counts"
        )
    if not any(b.kv_events.endpoint for b in cfg.backends):
        out.notes.append(
            "prefix state is the router's own estimate: give backends[].kv_events for the "
            "engines' own (docs/configuration.md)"
        )
    return out
