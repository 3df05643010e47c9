"""`gorgo epp`: the router as a Gateway API Inference Extension endpoint picker. The
extension's flags (flags.py), the command's parser (command.py), and its run (run.py: TLS,
the gRPC health service, the service on the extension's ports).
"""
