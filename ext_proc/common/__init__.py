"""Leaves every step may import: header, span and metric names, small asyncio and file
helpers. Imports nothing of the router.
"""
