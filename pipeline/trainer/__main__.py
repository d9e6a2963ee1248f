"""``python -m pipeline.trainer --config CONFIG.yaml --run-id RUN --store DIR [...]``.

Trains RUN to max_steps, resuming from the newest committed checkpoint under DIR/RUN, and
exits with a code from :mod:`pipeline.trainer.exit_codes` (0: the final checkpoint is committed).
"""

from __future__ import annotations

import argparse
import sys

from pipeline import envvars
from pipeline.process_exit import exit_process


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline.trainer", description=__doc__)
    parser.add_argument("--config", required=True, help="training config (YAML)")
    parser.add_argument("--run-id", required=True, help="the run to train or resume")
    parser.add_argument("--store", required=True, help="checkpoint store; the run uses STORE/RUN")
    parser.add_argument(
        "--ledger-url",
        help="SQLAlchemy URL of the ledger (optional). Default: "
        f"${envvars.TRACKS_LEDGER_URL.name}; prefer the variable when the URL holds a password, "
        "since argv is visible to every user in ps",
    )
    parser.add_argument("--attempt-no", type=int, help="attempt begun by an orchestrator")
    parser.add_argument("--fencing-token", type=int, help="that attempt's fencing token")
    args = parser.parse_args(argv)
    args.ledger_url = args.ledger_url or envvars.TRACKS_LEDGER_URL.get() or None
    if args.ledger_url and (args.attempt_no is None) != (args.fencing_token is None):
        parser.error("--attempt-no and --fencing-token go together")
    return args


def main(argv: list[str] | None = None) -> int:
    # The start-up's clock first (the receipt's timings.startup counts from here and from the
    # process's own start), then, before torch is imported (seconds): a SIGTERM during
    # start-up is a stop the trainer acts on (a rank dying of it would leave its peers
    # waiting), never a death.
    from pipeline.trainer.startup import StartupClock

    startup = StartupClock.at_main()
    from pipeline.trainer.stop import StopRequest

    stop = StopRequest()
    stop.install()
    from pipeline.distributed.launch import die_with_launcher

    die_with_launcher()
    args = parse_args(argv)
    from pipeline import ids, safepath
    from pipeline.checkpoint.layout import run_dir
    from pipeline.trainer import exit_codes

    # Checked before anything runs or is written: an id that would leave the store, alias
    # another run or overflow a file name is bad input, never worth a retry.
    try:
        run_dir(args.store, args.run_id)
        if args.attempt_no is not None:
            ids.attempt_no(args.attempt_no)
    except (ids.InvalidIdError, safepath.UnsafePathError) as exc:
        print(f"python -m pipeline.trainer: {exc}", file=sys.stderr)
        return exit_codes.BAD_INPUT
    from pipeline.trainer.train import run_training

    return run_training(
        args.config,
        run_id=args.run_id,
        store=args.store,
        ledger_url=args.ledger_url,
        attempt_no=args.attempt_no,
        fencing_token=args.fencing_token,
        stop=stop,
        startup=startup,
    )


if __name__ == "__main__":
    exit_process(main())
