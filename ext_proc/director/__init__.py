"""Step 3's recipe, above the routing core and the gateway queue's parts: the Director
(resolve the model, let the router admit, pass the admission seam, schedule, record), the
seam itself (`admission`: straight through with flow control off, as llm-d's legacy
admission controller) and the flow controller behind it (`flow_control`: the gateway
queue, the room rule, the peers' claims, what it did), and what the transports get back
(`outcomes`). Pure and synchronous on the router's clock. May import: vocab, config,
feeds, flow, core.
"""
