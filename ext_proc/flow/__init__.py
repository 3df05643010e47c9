"""Step 2b, flow control: the gateway queue between admission and scheduling. Which
objective and tenant a request belongs to (`classify`), when a backend has room for one
more (`room`), and the order the waiting requests are offered it (`queue`). Pure. May
import: vocab, config, common.
"""
