#!/usr/bin/env python3
"""status.py: compatibility shim for prompts written for the old status script.

`python3 status.py ARGS` runs `automaton status ARGS` with the same arguments, output and
exit code. Install it where prompts expect it:

    install -D -m 755 deploy/status.py ~/.automaton/scripts/status.py

The binary is found through $AUTOMATON_BIN, then `automaton` on PATH, then an `automaton`
next to this file.
"""
import os
import shutil
import sys


def find_binary():
    explicit = os.environ.get("AUTOMATON_BIN")
    if explicit:
        return explicit
    on_path = shutil.which("automaton")
    if on_path:
        return on_path
    beside = os.path.join(os.path.dirname(os.path.abspath(__file__)), "automaton")
    if os.access(beside, os.X_OK):
        return beside
    return None


def main():
    binary = find_binary()
    if binary is None:
        sys.stderr.write(
            "ERROR: the automaton binary was not found: put it on PATH or set "
            "AUTOMATON_BIN=/path/to/automaton\n"
        )
        return 2
    # exec keeps the exit code, stdout and stderr exactly the binary's.
    os.execv(binary, [binary, "status"] + sys.argv[1:])
    return 2


if __name__ == "__main__":
    sys.exit(main())
