"""Leaves every step may import: header, span and metric names, small asyncio and file
helpers. May import: nothing of the router.
"""
