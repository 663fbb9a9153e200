"""Shared-memory rings between the front end and the engine process.

``ring``: the sans-IO single-producer single-consumer byte ring. ``channel``: msgspec
framing and waiting (doorbells). ``process``: starting, handshaking with and
supervising the engine process. ``broadcast`` / ``broadcast_channel``: the same for one
writer and several readers (the engine's steps to its tensor-parallel workers).
"""
