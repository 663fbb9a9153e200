"""``python -m structllm.server.api_server SPEC_JSON``: an extra front-end process, started
by ``structllm run --api-server-count N`` (see ``serve.run_worker``)."""

from __future__ import annotations

import sys

import msgspec

from structllm.server.serve import WorkerSpec, run_worker


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m structllm.server.api_server SPEC_JSON (started by structllm run)", file=sys.stderr)
        return 2
    return run_worker(msgspec.json.decode(sys.argv[1], type=WorkerSpec))


if __name__ == "__main__":
    sys.exit(main())
