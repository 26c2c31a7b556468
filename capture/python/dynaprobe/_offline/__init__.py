"""Offline diagnosis, never imported while training: replays of stored calls, op localisation,
repro folders, stage bisection and bug-report bundles. ``dynaprobe.repro``, ``dynaprobe.bisect``
and ``dynaprobe.bundle`` are the commands over it."""
