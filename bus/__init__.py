"""The bus: codec, broker, pub/sub, request/reply, auth and transports (ZeroMQ and in-process).

Roles talk to `Transport` (bus/transport.py) only, so the same role code runs across processes
over ZeroMQ or inside one process over asyncio queues (tests, simulator).
"""
