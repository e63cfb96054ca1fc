"""Check a prepared dataset against the checksums its manifest recorded.

    python -m titanlite.data.verify FOLDER

Reads every shard's .bin and .idx in 1 MiB blocks (never a whole shard in memory) and
compares their CRC-32s with those manifest.json recorded when they were written
(checksums.py): what a copy to another machine, or a disk, may have changed without
changing any size. Exit 0 and one summary line when every file matches; exit 2 and one
`titanlite: error:` line naming the first file that is missing, has another size or
another CRC-32, or the folder that is not a prepared dataset. A folder prepared before
checksums were recorded cannot be verified: one line and exit 2 as well, since nothing
was checked. A separate command rather than a subcommand of `prepare`, whose arguments are
SOURCE OUTPUT: `verify` would read as a source there.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from titanlite.data.checksums import check_shard
from titanlite.data.shard_format import MANIFEST
from titanlite.data.token_shards import TokenShards
from titanlite.errors import INTERRUPTED_EXIT_CODE, USER_ERROR_EXIT_CODE, OneLineArgumentParser, TitanliteError, say
from titanlite.logging import init_logger, logger
from titanlite.observe.progress import Progress, amount_text

# The readers shared with training name the config field a path came from ("FIELD: path ...");
# here the path is the command's own argument, so the line starts with the path itself.
FIELD = "FOLDER"


def verify(folder: str | Path) -> str:
    """Check every shard file of a prepared folder; returns the summary line. The first
    problem is a TitanliteError naming the file."""
    started = time.monotonic()
    shards = TokenShards(folder, field=FIELD)  # the manifest, and every shard file's presence and size
    if (unrecorded := next((entry.name for entry in shards.entries if entry.crc32 is None), None)) is not None:
        raise TitanliteError(
            f"{shards.folder / MANIFEST} records no checksums for {unrecorded} (prepared before titanlite wrote "
            "them), so nothing can be verified; prepare it again to add them"
        )
    sizes = shards.shard_bytes
    progress = Progress(f"verify {shards.folder}", total=sum(sizes), unit="B")
    for entry, size in zip(shards.entries, sizes):
        check_shard(shards.folder, entry.name, entry.crc32, FIELD)
        progress.advance(size)
    return (
        f"{shards.folder}: all {len(sizes)} shards ({2 * len(sizes)} files, {amount_text(sum(sizes), 'B')}, "
        f"{shards.num_tokens:,} tokens) match the CRC-32s in {MANIFEST} ({time.monotonic() - started:.1f} s)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(
        prog="python -m titanlite.data.verify",
        description=__doc__.split("\n\n")[0],
        epilog="The on-disk format is described in docs/data.md.",
    )
    parser.add_argument(
        "folder", metavar=FIELD, help="a prepared dataset (written by python -m titanlite.data.prepare)"
    )
    init_logger(0)
    try:
        summary = verify(parser.parse_args(sys.argv[1:] if argv is None else argv).folder)
    except TitanliteError as error:
        say(f"titanlite: error: {str(error).removeprefix(f'{FIELD}: ')}")
        return USER_ERROR_EXIT_CODE
    except KeyboardInterrupt:
        say("titanlite: error: interrupted; nothing was changed")
        return INTERRUPTED_EXIT_CODE
    logger.info(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
