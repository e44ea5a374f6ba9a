"""``python -m widgets [--port N] [--address A] [--basic-auth PW] [--show] [--runs DIR]``: the served
app. ``workbench serve`` runs this; it is the one entry point into the UI layer."""

import sys

from widgets.app import main

if __name__ == "__main__":
    sys.exit(main())
