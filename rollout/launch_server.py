"""``python -m rollout.launch_server --model-path DIR [--tp-size N] [--host H] [--port P] ...`` (``rollout-server``).

Starts uvicorn with the app from ``rollout.server.app``; the Engine (its TokenizerManager included)
lives in this process, its schedulers and detokenizer in subprocesses. Binds to 127.0.0.1 unless told
otherwise. Exits non-zero if the engine cannot start.
"""

from __future__ import annotations

import logging
import sys
from typing import Sequence

from rollout.server.server_args import ServerArgs

logger = logging.getLogger("rollout.server")


def run(args: ServerArgs) -> int:
    """Serve until interrupted; the exit code is 1 if the engine failed to start."""
    try:
        import uvicorn

        from rollout.server.app import create_app
    except ImportError as e:
        print(f"the HTTP server needs the 'server' extra: pip install 'rollout-engine[server]' ({e})", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    if args.control_refusal is not None:
        logger.warning("bound to %s without --api-key: the weight-update and control endpoints will refuse to "
                       "run", args.host)
    failed: list[str] = []
    server: uvicorn.Server | None = None

    def on_engine_failure(message: str) -> None:
        failed.append(message)
        if server is not None:
            server.should_exit = True

    app = create_app(args, on_engine_failure=on_engine_failure)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.log_requests, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    server.run()
    if failed:
        print(failed[0], file=sys.stderr)
        return 1
    return 0 if server.started else 1


def main(argv: Sequence[str] | None = None) -> None:
    """The ``rollout-server`` entry point."""
    sys.exit(run(ServerArgs.from_cli(argv)))


if __name__ == "__main__":
    main()
