"""``python -m dynaprobe.repro DUMP --module NAME -o DIR``: a standalone folder that replays one
stored call of a module, eagerly and compiled. The command and the public names of the library,
``dynaprobe._offline.repro``, where the docs are."""

import sys

from dynaprobe._mechanics.graph_runner import compiler_bisect  # noqa: F401 - a class repro's
from dynaprobe._offline.repro import (  # noqa: F401 - the public names
    ReproData,
    load_repro,
    main,
    matches,
    replay,
    write_graph_folder,
    write_repro,
)

if __name__ == "__main__":
    sys.exit(main())
