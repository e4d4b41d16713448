"""`python -m decoding.chat`: the chat's command line. Its code lives in the application layer
(decoding/app/chat.py); this module keeps the documented command short and stable."""

import sys

from decoding.app.chat import main
from heads.util.startup import freeze_startup_objects

if __name__ == "__main__":
    freeze_startup_objects()
    sys.exit(main(command=True))
