"""``python -m widgets [--port N] [--address A] [--basic-auth PW|USERS.json] [--show] [--runs DIR]``: the
served app. ``workbench serve`` runs this; it is the one entry point into the UI layer."""

import sys

from widgets.serve_auth import refuse_bad_basic_auth

if __name__ == "__main__":
    refuse_bad_basic_auth(sys.argv[1:])  # a bad users file: one line and exit 2, before the UI loads (seconds)
    from widgets.app import main  # Panel, HoloViews and Bokeh load only once the login is known to be sound

    sys.exit(main())
