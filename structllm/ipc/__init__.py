"""Shared-memory rings between the front end and the engine process.

``ring``: the sans-IO single-producer single-consumer byte ring. ``channel``: msgspec
framing and waiting (doorbells). ``process``: starting, handshaking with and
supervising the engine process.
"""
