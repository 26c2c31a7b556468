"""``python -m dynaprobe.remedy DUMP``: each failing module's stored call replayed under
candidate changes (inductor switches, other backends, the module uncompiled), and the cheapest
change that passes every row printed as code to paste. The command and the public names of the
library, ``dynaprobe._offline.remedy``, where the docs are."""

import sys

from dynaprobe._checking.confirming import Confirmation  # noqa: F401 - checker.confirm's result
from dynaprobe._offline.remedy import (  # noqa: F401 - the public names
    SWITCHES,
    Change,
    ModuleRemedy,
    RemedyResult,
    Trial,
    candidates,
    main,
    remedy_call,
    remedy_dump,
)

if __name__ == "__main__":
    sys.exit(main())
