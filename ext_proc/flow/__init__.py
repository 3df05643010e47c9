"""Step 2b, flow control's pure parts: the gateway queue between admission and scheduling.
Which objective and tenant a request belongs to (`classify`), when a backend has room for
one more (`room`), the order the waiting requests are offered it (`queue`), and room shared
by several routers (`shared`); the flow controller that drives them is
director.flow_control. Pure. May import: vocab, config, common.
"""
