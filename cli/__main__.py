import sys

from geofed.cli import main

sys.exit(main())
