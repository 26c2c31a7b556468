"""``dynaprobe bundle DUMP -o report.tar.gz`` (``python -m dynaprobe.bundle``): one archive to
attach to a bug report. The command and the public names of the library,
``dynaprobe._offline.bundle``, where the docs are."""

import sys

from dynaprobe._offline.bundle import Bundle, main, write_bundle  # noqa: F401 - the public names

if __name__ == "__main__":
    sys.exit(main())
