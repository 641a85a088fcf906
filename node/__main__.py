import sys

from geofed.node.cli import main

sys.exit(main())
