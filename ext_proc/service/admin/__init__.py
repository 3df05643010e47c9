"""The admin HTTP API on loopback (api.py: /healthz, /readyz, /metrics, /state, /backends,
/tuner), who may use it (guard.py: Host, token, JSON, Origin), its OpenAPI document
(openapi.py, with the component schemas of schemas.py), and the operator's page
(operator_page.py, shipping page/: /ui and the JSON it polls).
"""
