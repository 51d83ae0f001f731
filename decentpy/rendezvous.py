"""``python -m decentpy.rendezvous --port P``: host the rendezvous store of elastic jobs
(:mod:`decentpy.elastic.rendezvous`)."""

import sys

from .elastic.rendezvous import main

if __name__ == "__main__":
    sys.exit(main())
