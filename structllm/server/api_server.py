"""``python -m structllm.server.api_server SPEC_JSON``: an extra front-end process, started
by ``structllm run --api-server-count N`` (see ``serve.run_api_server``)."""

from __future__ import annotations

import sys

import msgspec

from structllm.server.serve import ApiServerSpec, run_api_server


def main() -> int:
    if len(sys.argv) != 2:
        print(
            "usage: python -m structllm.server.api_server SPEC_JSON (started by structllm run)",
            file=sys.stderr,
        )
        return 2
    return run_api_server(msgspec.json.decode(sys.argv[1], type=ApiServerSpec))


if __name__ == "__main__":
    sys.exit(main())
