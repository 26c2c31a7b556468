"""``python -m dynaprobe.bisect DUMP --module NAME``: a stored call replayed through
torch.compile's stages to find the first that changes its numbers. The command and the public
names of the library, ``dynaprobe._offline.bisect``, where the docs are."""

import sys

from dynaprobe._offline.bisect import (  # noqa: F401 - the public names
    STAGES,
    BisectResult,
    Stage,
    StageResult,
    bisect_call,
    main,
    recorded_stage,
)

if __name__ == "__main__":
    sys.exit(main())
