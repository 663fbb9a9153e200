"""Helpers shared by the tests, in one place (test modules never import each other):

- ``procs``: processes and shared memory as ``/proc`` and ``/dev/shm`` show them, the
  environment of a child that imports ``tests``, and ``wait_for`` (a hang guard);
- ``server``: a real ``structllm run`` subprocess and raw-socket streams to it;
- ``models``: tiny random-weight checkpoints, the exact float32 settings, and
  transformers as the reference;
- ``attention``: paged K/V set-ups for the attention kernels;
- ``rings``: frame payloads for the ring tests; ``ipc_peer``: both ends of the
  cross-process ring stress test (also run as a script).
"""
