"""The shared vocabulary: the values and protocols every step of a request's flow speaks
(a request, a candidate, a decision, a record in flight, the lifecycle events and their
listeners, a backend as configured, a policy, parameters with ranges, the error answers
the front door gives). A leaf. May import: nothing of the router.
"""
